"""``python -m megaflow.cli`` and the ``megaflow`` console script (``entry``): the ``megaflow`` command, what
torchrun launches on every rank."""
import sys

from megaflow.cli import main
from megaflow.rundir.interrupt import exit_without, lingering_threads


def entry() -> None:
    """``main``, then exit with its status. The command ends even when something it ran, usually a custom reward,
    left a non-daemon thread running, which Python's exit would wait for forever: after ``LEFTOVER_GRACE_S`` it
    leaves without it (``exit_without``: one line, stdout flushed, atexit handlers run, ``os._exit``). The
    processes a reward started, double-forked ones included, ``main`` already ended (``adopt_orphans``,
    ``kill_children``). Here, not in ``main``: a caller of ``main`` in its own process keeps its exit."""
    code = main()
    if threads := lingering_threads():
        exit_without(threads, code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
