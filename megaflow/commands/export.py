"""A run's checkpoint as a diffusers pipeline (``megaflow export``): the run's pipeline with the transformer's
weights replaced by the checkpoint's; the conversion is shared with ``tools/convert_checkpoint.py``.
Design notes: docs/design/commands.md.
"""
from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

from megaflow.commands.model_card import ENCODER_FILE, export_card
from megaflow.config.remote_code import refuse_remote_code
from megaflow.rundir.checkpoints import MODEL_DIR, find_checkpoint
from megaflow.trainer.manifest import verify_manifest
from megaflow.trainer.model_tensors import ADAPTER_SUFFIXES, diffusers_shapes  # noqa: F401 - re-exported (tools/)

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
INDEX_FILE = WEIGHTS_FILE + ".index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def check_diffusers_state(state: dict, expected: dict[str, tuple]) -> None:
    """ValueError naming the first missing, mis-shaped or unexpected tensor of ``state``."""
    for name, shape in expected.items():
        if name not in state:
            raise ValueError(f"tensor {name!r} is missing")
        if tuple(state[name].shape) != shape:
            raise ValueError(f"shape mismatch for {name!r}: {tuple(state[name].shape)}, expected {shape}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]!r} (wrong architecture?)")


def checkpoint_transformer(model_dir: str | Path, *, shadow: str | None = None, trust: bool = False,
                           checked_manifest: bool = False):
    """(family, diffusers config dict, diffusers state dict) of a dist checkpoint's model, read without building a
    model and checked against the recorded diffusers class; LoRA adapters excluded. ``shadow``: those weights instead."""
    from megaflow.models.registry import get_family
    from megaflow.trainer.checkpoint import load_full_state_dict

    meta, full = load_full_state_dict(model_dir, shadow=shadow, trust=trust, checked_manifest=checked_manifest)
    family = get_family(meta["family"])
    config = family.config_from_diffusers(meta["diffusers_config"])
    base = {k: v for k, v in full.items() if not k.endswith(ADAPTER_SUFFIXES)}
    state = family.weight_map.to_diffusers(base, config)
    check_diffusers_state(state, diffusers_shapes(family, meta["diffusers_config"]))
    return family, family.config_to_diffusers(config), state


def checkpoint_adapters(model_dir: str | Path, lora, *, shadow: str | None = None, trust: bool = False,
                        checked_manifest: bool = False) -> dict:
    """The LoRA adapters of a dist checkpoint as a PEFT-named state dict; ValueError names the first disagreeing tensor."""
    from megaflow.models.common.lora_map import lora_weight_map
    from megaflow.models.registry import get_family
    from megaflow.trainer.checkpoint import load_full_state_dict

    meta, full = load_full_state_dict(model_dir, shadow=shadow, trust=trust, checked_manifest=checked_manifest)
    family = get_family(meta["family"])
    config = family.config_from_diffusers(meta["diffusers_config"])
    adapters = {k: v for k, v in full.items() if k.endswith(ADAPTER_SUFFIXES)}
    return lora_weight_map(family.weight_map, lora).to_diffusers(adapters, config)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``5GB``, ``500MB``, ``100KB`` (powers of 10, as diffusers / huggingface_hub),
    ``2GiB`` (powers of 2) or a plain byte count; ValueError (naming --max-shard-size) otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        raw = str(text).strip().upper().replace(" ", "")
        digits = raw.rstrip("KMGTIB")
        unit = raw[len(digits):]
        try:
            size = int(float(digits) * _SIZE_UNITS[unit]) if digits else 0
        except (ValueError, KeyError, OverflowError):
            size = 0
    if size <= 0:
        raise ValueError(f"--max-shard-size {text!r}: want a positive size such as 5GB, 500MB, 100KB or 2GiB")
    return size


def save_transformer_weights(directory: Path, state: dict, *, max_shard_size: int | None = None) -> list[Path]:
    """Write ``state`` into a diffusers model dir, sharded with an index when over ``max_shard_size`` bytes, named
    as diffusers' ``save_pretrained`` does."""
    from safetensors.torch import save_file

    if max_shard_size is None:
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / WEIGHTS_FILE))
        return [directory / WEIGHTS_FILE]
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state, filename_pattern=WEIGHTS_FILE.replace(".safe", "{suffix}.safe"),
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({k: state[k].contiguous() for k in names}, str(directory / filename), metadata={"format": "pt"})
    written = [directory / f for f in split.filename_to_tensors]
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        written.append(directory / INDEX_FILE)
        written[-1].write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def run_pipeline(run_dir: Path) -> Path:
    """The diffusers pipeline dir a run trained (``model.pretrained`` of its config.toml, else
    ``<run>/tiny-pipeline``); ValueError naming what is missing."""
    from megaflow.config import load_config

    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ValueError(f"--run {run_dir}: not a megaflow run dir ({config_path.name} not found)")
    cfg = load_config(config_path)
    if cfg.model.pretrained:
        pipeline, origin = Path(cfg.model.pretrained), f"{config_path}: model.pretrained"
    else:
        pipeline, origin = run_dir / "tiny-pipeline", f"{config_path} (model.pretrained empty)"
    for needed in ("model_index.json", "transformer/config.json"):
        if not (pipeline / needed).is_file():
            raise ValueError(f"{origin}: pipeline {pipeline} has no {needed}")
    return pipeline


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory; refusing to overwrite")


def _copy_pipeline(pipeline: Path, dst: Path) -> None:
    """Copy the pipeline into ``dst`` without the transformer's weight files (config.json kept) and the base's own
    README.md / RECIPE.md."""
    def skip(directory: str, names: list[str]) -> list[str]:
        if Path(directory).resolve() == pipeline.resolve():  # the base's own card and recipe: the export has its own
            return [n for n in names if n in ("README.md", "RECIPE.md")]
        if Path(directory).resolve() != (pipeline / "transformer").resolve():
            return []
        return [n for n in names if n.endswith(_WEIGHT_SUFFIXES)]

    shutil.copytree(pipeline, dst, ignore=skip, dirs_exist_ok=True)


def export_run(run_dir: str | Path, out: str | Path, iteration: int | None = None, *, ema: bool = True,
               lora_only: bool = False, max_shard_size: str | int = "5GB", trust_checkpoint: bool = False,
               base_model: str | None = None, trust_remote_code: bool = False) -> dict:
    """Write the run's pipeline with the weights of checkpoint ``iteration`` (None = latest) to ``out``: the EMA when
    the run kept one and ``ema``, else the trained weights, with a README.md model card (commands/model_card.py);
    ``lora_only``: the adapter (diffusers' LoRA file and a PEFT adapter directory) and its card.
    An SD3 export with a megaflow prompt length also gets ``encode_prompts.py``. Returns what was written. The
    checkpoint is checked against its manifest first; ``trust_checkpoint`` reads one without a manifest unchecked. A
    pipeline that names code (megaflow.config.remote_code) is refused unless ``trust_remote_code``. One the run
    rotates out meanwhile is replaced by the new latest (:func:`read_kept_checkpoint`); a full disk is one NoSpace
    line with nothing left (:func:`write_into`)."""
    started = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ValueError(f"--run {run_dir}: no such directory")
    pipeline = run_pipeline(run_dir)
    refuse_remote_code(pipeline, f"--run {run_dir}: pipeline", trust=trust_remote_code)
    shard_bytes = parse_size(max_shard_size)
    if lora_only:
        _check_lora_run(run_dir)
    find_checkpoint(run_dir, iteration)  # none there: said before --out is looked at
    _check_out(out)
    lora, shadow = _run_settings(run_dir, ema)
    read = dict(trust=trust_checkpoint, checked_manifest=True)  # the manifest, model/ included, checked first

    def read_weights(ckpt: Path):
        verify_manifest(ckpt, trust=trust_checkpoint)
        if lora_only:
            return checkpoint_adapters(ckpt / MODEL_DIR, lora, shadow=shadow, **read)
        family, state = _checked_state(pipeline, ckpt, shadow, read)
        adapters = checkpoint_adapters(ckpt / MODEL_DIR, lora, shadow=shadow, **read) if lora is not None else None
        return family, state, adapters

    it, ckpt, weights = read_kept_checkpoint(run_dir, iteration, read_weights)
    pipeline_class = json.loads((pipeline / "model_index.json").read_text()).get("_class_name")
    result = {"out": str(out), "iteration": it, "checkpoint": str(ckpt), "pipeline": str(pipeline),
              "weights": shadow or "trained"}
    if lora_only:
        adapters = weights
        length = prompt_length(pipeline)
        card = export_card(run_dir, base_model=base_model or pipeline.resolve().name, iteration=it,
                           weights=result["weights"], adapters=adapters, lora=lora, prompt_length=length,
                           lora_only=True)

        def write_lora(tmp: Path) -> None:
            _write_adapter(tmp, adapters, lora, pipeline_class)
            card.save(tmp / "README.md")
            if length is not None:
                shutil.copyfile(_ENCODER_SOURCE, tmp / ENCODER_FILE)

        write_into(out, write_lora, tensor_bytes(adapters))
        return {**result, "lora_tensors": len(adapters), "seconds": round(time.perf_counter() - started, 3)}
    family, state, adapters = weights
    files: list[Path] = []
    card = export_card(run_dir, base_model=base_model or pipeline.resolve().name, iteration=it,
                       weights=result["weights"], adapters=adapters, lora=lora, prompt_length=prompt_length(pipeline))

    def write(tmp: Path) -> None:
        _copy_pipeline(pipeline, tmp)
        card.save(tmp / "README.md")
        files.extend(save_transformer_weights(tmp / "transformer", state, max_shard_size=shard_bytes))
        if adapters is not None:
            _write_adapter(tmp, adapters, lora, pipeline_class)
        if prompt_length(pipeline) is not None:
            shutil.copyfile(_ENCODER_SOURCE, tmp / ENCODER_FILE)

    write_into(out, write, pipeline_bytes(pipeline) + tensor_bytes(state) + tensor_bytes(adapters or {}))
    return {**result, "family": family.name, "tensors": len(state), "lora_tensors": len(adapters or {}),
            "transformer_files": [p.name for p in files], "seconds": round(time.perf_counter() - started, 3)}


def _checked_state(pipeline: Path, ckpt: Path, shadow: str | None, read: dict):
    """(family, diffusers state dict) of the checkpoint (``read``: checkpoint_transformer's trust arguments),
    checked against the pipeline's transformer."""
    tconfig = json.loads((pipeline / "transformer" / "config.json").read_text())
    family, _, state = checkpoint_transformer(ckpt / MODEL_DIR, shadow=shadow, **read)
    if tconfig.get("_class_name") != family.diffusers_class:
        raise ValueError(f"{ckpt / MODEL_DIR} holds a {family.diffusers_class} ({family.name}) but "
                         f"{pipeline}/transformer is a {tconfig.get('_class_name')}")
    try:
        check_diffusers_state(state, diffusers_shapes(family, tconfig))
    except ValueError as e:
        raise ValueError(f"{ckpt / MODEL_DIR} does not fit {pipeline}/transformer: {e}") from None
    return family, state


def write_into(out: Path, write, needed: int) -> None:
    """``write(tmp)`` into a temp dir beside ``out``, then renamed onto ``out`` (still free or empty). ``needed``:
    the bytes it writes; fewer free, or a write that fills the disk, is one NoSpace line (megaflow.trainer.disk_full)
    and nothing of it is left."""
    from megaflow.trainer.disk_full import NoSpace, disk_full, tree_bytes

    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < needed:
        raise NoSpace(out, needed, free, out.parent, "; nothing written")
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        _check_out(out)  # still free (nothing appeared while we wrote)
        tmp.rename(out)  # onto an empty dir: replaced atomically
    except BaseException as e:  # safetensors' and copytree's errors on a full disk are no ENOSPC OSError
        full = None if isinstance(e, ValueError) else disk_full(e, out, needed, written=tree_bytes(tmp))
        if full is None:
            raise
        raise NoSpace(out, needed, full.free, full.where, "; nothing of it is left") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def pipeline_bytes(pipeline: Path) -> int:
    """Bytes of what ``_copy_pipeline`` copies: the pipeline's files (links followed) but the transformer weights."""
    total = 0
    for f in pipeline.rglob("*"):
        if f.is_file() and not (f.parent.resolve() == (pipeline / "transformer").resolve()
                                and f.name.endswith(_WEIGHT_SUFFIXES)):
            total += f.stat().st_size
    return total


ROTATIONS = 3  # times the latest checkpoint may be replaced while an export reads it


def read_kept_checkpoint(run_dir: Path, iteration: int | None, read):
    """(iteration, checkpoint dir, ``read(checkpoint dir)``) of checkpoint ``iteration`` (None = the latest). A
    running run rotates checkpoints out (megaflow.rundir.checkpoints.remove_checkpoint: renamed away, then deleted);
    a read that failed on one that is gone is retried on the new latest, or for a named ``iteration`` refused in one
    line naming those kept. A failure of a checkpoint still there is raised as it is."""
    from megaflow.rundir.checkpoints import list_checkpoints

    for _ in range(ROTATIONS):
        it, ckpt = find_checkpoint(run_dir, iteration)
        try:
            return it, ckpt, read(ckpt)
        except BaseException as e:  # torch's CheckpointException (a file gone mid-read) is a BaseException
            kept = list_checkpoints(run_dir)
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or (it, ckpt) in kept:
                raise
        if iteration is not None:
            raise ValueError(f"{ckpt}: removed while it was read (the run rotated it out, train.keep_checkpoints); "
                             f"it keeps iterations {[i for i, _ in kept]}: pass one of them as --iteration")
    raise ValueError(f"{run_dir}: its latest checkpoint was replaced {ROTATIONS} times while it was read; retry, "
                     "or pass --iteration with one the run keeps")


def _write_adapter(directory: Path, adapters: dict, lora, pipeline_class: str) -> None:
    from megaflow.models.common.lora_files import write_adapter
    write_adapter(directory, adapters, rank=lora.rank, alpha=lora.alpha, pipeline_class=pipeline_class)


def _check_lora_run(run_dir: Path) -> None:
    from megaflow.config import load_config
    if load_config(run_dir / "config.toml").lora.rank == 0:
        raise ValueError(f"--lora-only: {run_dir} is a full-parameter run (lora.rank = 0): it has no adapters; "
                         "export the whole pipeline without --lora-only")


_ENCODER_SOURCE = Path(__file__).resolve().parents[1] / "models" / "sd3" / "text.py"


def prompt_length(pipeline: Path) -> int | None:
    """The SD3 pipeline's prompt length for every text encoder (its megaflow.json ``max_sequence_length``), or
    None: not an SD3 pipeline megaflow trained with a fixed length (diffusers' own prompt encoding then serves)."""
    meta = pipeline / "megaflow.json"
    index = json.loads((pipeline / "model_index.json").read_text())
    if index.get("_class_name") != "StableDiffusion3Pipeline" or not meta.is_file():
        return None
    length = json.loads(meta.read_text()).get("max_sequence_length")
    return length if isinstance(length, int) and length > 0 else None


def _run_settings(run_dir: Path, ema: bool):
    """(the run's LoRA settings or None for a full-parameter run, "ema" when its EMA is to be exported or None),
    from its config.toml."""
    from megaflow.config import load_config
    from megaflow.trainer.settings import lora_settings
    cfg = load_config(run_dir / "config.toml")
    return lora_settings(cfg), "ema" if ema and cfg.train.ema_decay > 0 else None
