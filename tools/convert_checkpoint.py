"""Convert a DiT between a diffusers transformer directory and a megatron dist checkpoint.

    python tools/convert_checkpoint.py to-megatron --src <diffusers transformer dir> --dst <dir> --tp 2 --pp 1
    python tools/convert_checkpoint.py to-diffusers --src <megatron checkpoint dir> --dst <dir>

to-megatron launches tp*pp local gloo ranks that each save their shard; the result is a dist
checkpoint that loads at ANY TP/PP layout (tensors are stored by global name + shard metadata).
to-diffusers reads the checkpoint in one process and writes config.json +
diffusion_pytorch_model.safetensors.

Both directions validate before writing anything and exit with code 2 and one line on stderr naming
the problem: first with the standard library only, before torch or megatron is imported (missing
``--src``, an existing ``--dst``, ``--tp`` / ``--pp`` that do not divide the attention heads / blocks of
``config.json``, a missing or truncated safetensors file or shard, a checkpoint without ``.metadata`` or
``megaflow_model.json``: ``megaflow.config.files``), then after loading (unknown architecture, missing /
unexpected / mis-shaped tensors; a checkpoint is read under megaflow.trainer.dcp_metadata's trust rule).
The result is written into a temp
dir next to ``--dst`` and renamed into place. An existing ``--dst`` is never overwritten.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import uuid
import warnings
from pathlib import Path

from megaflow.config.files import check_megatron_checkpoint, check_weights_dir, read_json
from megaflow.config.load import ConfigError
from megaflow.config.remote_code import refuse_remote_code
from megaflow.parallel.dims import ParallelDims


class ConvertError(Exception):
    """A user-facing conversion failure (printed as one line)."""


def _family_for(diffusers_config: dict):
    from megaflow.models.registry import family_names, get_family

    cls = diffusers_config.get("_class_name")
    for name in family_names():
        fam = get_family(name)
        if fam.diffusers_class == cls:
            return fam
    raise ConvertError(f"unsupported architecture {cls!r} (known: {[get_family(n).diffusers_class for n in family_names()]})")


def _check_shapes(state: dict, fam, diffusers_config: dict) -> None:
    from megaflow.commands.export import check_diffusers_state, diffusers_shapes

    try:
        check_diffusers_state(state, diffusers_shapes(fam, diffusers_config))
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _new_tmp(dst: Path) -> Path:
    if dst.exists():
        raise ConvertError(f"{dst} already exists; refusing to overwrite")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f"{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def to_megatron(src: Path, dst: Path, tp: int, pp: int) -> None:
    from megaflow.testing.dist import RankError, run_multiprocess
    from megaflow.trainer import checkpoint
    from megaflow.trainer.manifest import write_manifest

    dconfig = read_json(src / "config.json", "--src")
    fam = _family_for(dconfig)
    try:
        fam.config_from_diffusers(dconfig)  # its own checks of the config; tp / pp: _check_layout, before torch
        state = checkpoint.read_diffusers_weights(src)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    _check_shapes(state, fam, dconfig)
    del state
    tmp = _new_tmp(dst)
    try:
        try:
            run_multiprocess(checkpoint.save_from_diffusers, tp * pp, str(src), str(tmp),
                             dict(tp=tp, pp=pp), fam.name, timeout_s=3600)
        except RankError as e:  # first failing rank's last traceback line (its error)
            first = e.remote_traceback.split("\n(rank ")[0].strip().splitlines()
            raise ConvertError(f"rank {e.rank}: {first[-1] if first else 'failed'}") from None
        checkpoint.write_meta(tmp, family=fam.name, diffusers_config=dconfig)
        write_manifest(tmp)  # last: every file's size and digest (megaflow.trainer.manifest)
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def to_diffusers(src: Path, dst: Path, *, trust: bool = False) -> None:
    from megaflow.commands.export import checkpoint_transformer, save_transformer_weights, tensor_bytes, write_into
    from megaflow.trainer.disk_full import NoSpace

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(dconfig, indent=2))
        save_transformer_weights(tmp, state)

    try:
        _, dconfig, state = checkpoint_transformer(src, trust=trust)
        write_into(dst, write, tensor_bytes(state))  # a full disk: one line, nothing left (as megaflow export)
    except (ValueError, NoSpace) as e:
        raise ConvertError(str(e)) from None


def _check_layout(dconfig: dict, tp: int, pp: int, where: Path) -> None:
    """--tp divides the attention heads and --pp the blocks (FLUX: double- and single-stream) of the config."""
    def count(key: str) -> int | None:
        value = dconfig.get(key)
        return value if type(value) is int and value > 0 else None

    blocks = count("num_layers")
    if dconfig.get("_class_name") == "FluxTransformer2DModel" and blocks is not None:
        blocks = blocks + (count("num_single_layers") or 0)
    try:
        ParallelDims(tp=tp, pp=pp).check_model(count("num_attention_heads"), blocks, str(where), keys=("--tp", "--pp"))
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _check_inputs(command: str, src: Path, dst: Path, tp: int, pp: int, *, trust_remote_code: bool = False) -> None:
    """What can be checked with the standard library, before torch / megatron are imported."""
    if not src.is_dir():
        raise ConvertError(f"--src {src} is not a directory")
    if dst.exists():
        raise ConvertError(f"{dst} already exists; refusing to overwrite")
    if tp < 1 or pp < 1:
        raise ConvertError(f"--tp {tp} / --pp {pp}: both must be >= 1")
    if command == "to-megatron":
        dconfig = read_json(src / "config.json", "--src")
        _check_layout(dconfig, tp, pp, src / "config.json")
        check_weights_dir(src, "--src")
        refuse_remote_code(src, "--src", trust=trust_remote_code)
    else:
        check_megatron_checkpoint(src, "--src")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-megatron", help="diffusers transformer dir -> megatron dist checkpoint")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--dst", type=Path, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="Convert a transformer dir whose config.json names code (auto_map): only from a trusted "
                   "source; without it such a dir is refused.")
    p = sub.add_parser("to-diffusers", help="megatron dist checkpoint -> diffusers transformer dir")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--dst", type=Path, required=True)
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="Read a checkpoint that has no MANIFEST.json (written by an older megaflow) without checking "
                   "its files, and skip the trust checks of its metadata and pickles (.metadata, non-tensor items), "
                   "which torch then unpickles and follows: use only for checkpoints from a trusted source. A "
                   "manifest that is there is always checked.")
    args = parser.parse_args(argv)
    try:
        _check_inputs(args.command, args.src, args.dst, getattr(args, "tp", 1), getattr(args, "pp", 1),
                      trust_remote_code=getattr(args, "trust_remote_code", False))
        warnings.filterwarnings("ignore", category=UserWarning)  # megatron's import-time notices (no TE/apex)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
        import megaflow  # noqa: F401  (import guards before megatron)
        if args.command == "to-megatron":
            to_megatron(args.src, args.dst, args.tp, args.pp)
        else:
            to_diffusers(args.src, args.dst, trust=args.trust_checkpoint)
    except (ConvertError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
