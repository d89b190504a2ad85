"""StopRequests: the first signal asks for a stop, a repeat within DUPLICATE_S is the same request (torchrun
passes a terminal's Ctrl-C on to workers that already got it), a later one abandons (KeyboardInterrupt)."""
from __future__ import annotations

import os
import signal

import pytest

from megaflow.run import interrupt


def test_repeat_within_the_window_is_the_same_stop_and_a_later_one_abandons(monkeypatch):
    stop = interrupt.StopRequests()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy: still one request
        assert stop.signum == signal.SIGINT and stop.agreed() == signal.SIGINT
        monkeypatch.setattr(interrupt, "DUPLICATE_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
