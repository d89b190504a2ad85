"""The metrics backends' preflight (``[logging]``): what each needs on this machine is there before the run starts,
each missing piece one line. Invariant: standard library only, nothing contacted (W&B credentials are looked up where
wandb itself looks: WANDB_API_KEY, then the netrc file ``wandb login`` writes).
"""
from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from megaflow.config.load import ConfigError
from megaflow.config.schema import MegaflowConfig

WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")
WANDB_DEFAULT_HOST = "https://api.wandb.ai"


def check_logging(cfg: MegaflowConfig) -> None:
    """ConfigError naming what ``logging.tensorboard`` / ``logging.wandb`` lacks here."""
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard = true: the tensorboard package is not installed "
                          "(pip install tensorboard, or set logging.tensorboard = false)")
    if not cfg.logging.wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb = true: the wandb package is not installed (pip install wandb, or set "
                          "logging.wandb = false)")
    if os.environ.get("WANDB_MODE", "").strip().lower() in WANDB_OFFLINE_MODES or wandb_key_found():
        return
    raise ConfigError("logging.wandb = true: no W&B credentials (run 'wandb login' or set WANDB_API_KEY), or set "
                      "WANDB_MODE=offline to log under the run dir")


def wandb_key_found() -> bool:
    """WANDB_API_KEY is set, or the netrc file (NETRC, else ~/.netrc) has an entry for W&B's host
    (WANDB_BASE_URL's, else api.wandb.ai) with a password."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST).hostname or ""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])
