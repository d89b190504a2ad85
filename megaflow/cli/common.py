"""What every ``megaflow`` subcommand shares: config arguments, the checked config, JSON output."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from megaflow.config import MegaflowConfig, load_config
from megaflow.config.preflight import preflight

Handler = Callable[[argparse.Namespace], int]
REMOTE_CODE_HELP = ("Run the code a model directory names (a config's auto_map, a custom class in model_index.json, "
                    "imported from a .py in the directory); without it such a directory is refused. Only for a "
                    "directory from a trusted source.")


def add_config_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--config", "-c", default=default, help="TOML run file (configs/*.toml)"
                   + (f"; default {default}." if default else "."))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Override one config value (repeatable), e.g. --set parallel.tp=2.")


def load_checked(args: argparse.Namespace, command: str) -> MegaflowConfig:
    """The validated config of ``-c`` / ``--set``, preflight-checked for ``command`` (files it names,
    the machine, cross-field rules) before anything heavy is imported."""
    trust = ["model.trust_remote_code=true"] if getattr(args, "trust_remote_code", False) else []
    return preflight(load_config(args.config, [*args.overrides, *trust]), command)


def apply_device(cfg: MegaflowConfig) -> MegaflowConfig:
    """Apply ``run.device`` to this process and the engine workers it starts
    (megaflow.parallel.distributed.select_device) before anything touches CUDA."""
    from megaflow.parallel.distributed import select_device
    select_device(cfg.run.device)
    return cfg


def run_config(args: argparse.Namespace, command: str) -> MegaflowConfig:
    """The checked config of a command that computes, with ``run.device`` applied."""
    return apply_device(load_checked(args, command))


def add_trust_remote_code_arg(p: argparse.ArgumentParser, *, sets_config: bool = False) -> None:
    p.add_argument("--trust-remote-code", action="store_true", help=REMOTE_CODE_HELP + (
        " Sets model.trust_remote_code." if sets_config else ""))


def add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", "-v", action="store_true",
                   help="Show the SGLang engines' logs (per-stage timings of every call), third-party info logs "
                   "and warnings on the terminal, with no progress bar; by default engine logs go to "
                   "<run dir>/logs/engine<i>.log.")


def print_json(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def emit(result: dict, args: argparse.Namespace) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, sort_keys=True, indent=2) + "\n")
    print_json(result, args.json)
