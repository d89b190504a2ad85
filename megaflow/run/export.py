"""A run's checkpoint as a diffusers pipeline (``megaflow export``), and the checkpoint -> diffusers
transformer conversion it shares with ``tools/convert_checkpoint.py``.

The export is the run's pipeline -- ``model.pretrained`` from ``<run>/config.toml``, or the run's own
``tiny-pipeline/`` when that is empty -- with the transformer's weights replaced by the checkpoint's:

    <out>/transformer/config.json                          the pipeline's, unchanged
    <out>/transformer/diffusion_pytorch_model.safetensors  the checkpoint's weights (their dtype), diffusers names
    <out>/<everything else>                                copied unchanged (text encoders, VAE, scheduler,
                                                           tokenizers, model_index.json, megaflow.json, ...)

A LoRA run (``lora.rank`` > 0 in its config) trains adapters on a frozen base: the export is then the
pipeline with the checkpoint's (unchanged) base weights plus the adapter in the diffusers/PEFT format,

    <out>/pytorch_lora_weights.safetensors                 transformer.<module>.lora_A/B.weight, r / lora_alpha /
                                                           target_modules in its header (diffusers' save_lora_weights)

so ``pipe = StableDiffusion3Pipeline.from_pretrained(out); pipe.load_lora_weights(out)`` is the trained model
(with HF_HUB_OFFLINE=1 diffusers wants ``weight_name="pytorch_lora_weights.safetensors"`` too).

Everything that can be checked without loading tensors (run dir, config, pipeline, checkpoint, ``--out``)
is checked first; the weights must match the pipeline's transformer tensor for tensor (names and shapes)
before anything is written. The pipeline is written into a temp dir beside ``out`` and renamed into place.
Failures are ``ValueError`` with one line naming the file or value.
"""
from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

from megaflow.run.checkpoints import MODEL_DIR, find_checkpoint

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
ADAPTER_SUFFIXES = (".lora.a", ".lora.b")  # megatron names of LoRA adapter tensors (megaflow.models.common.lora)
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def diffusers_shapes(family, diffusers_config: dict) -> dict[str, tuple]:
    """Tensor shapes of ``family``'s diffusers class for this config (built on the meta device)."""
    import diffusers
    import torch

    cls = getattr(diffusers, family.diffusers_class)
    with torch.device("meta"):
        model = cls.from_config(diffusers_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


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


def checkpoint_transformer(model_dir: str | Path, *, shadow: str | None = None):
    """(family, diffusers config dict as the family writes it, diffusers state dict) of a megatron dist
    checkpoint's model, read in this process without building a model; the state is checked against
    the diffusers class of the config recorded in the checkpoint. A LoRA run's adapter tensors are not
    part of it (``checkpoint_adapters`` reads them). ``shadow`` ("ema"): those weights instead of the trained ones."""
    from megaflow.models.registry import get_family
    from megaflow.trainer.checkpoint import load_full_state_dict

    meta, full = load_full_state_dict(model_dir, shadow=shadow)
    family = get_family(meta["family"])
    config = family.config_from_diffusers(meta["diffusers_config"])
    base = {k: v for k, v in full.items() if not k.endswith(ADAPTER_SUFFIXES)}
    state = family.weight_map.to_diffusers(base, config)
    check_diffusers_state(state, diffusers_shapes(family, meta["diffusers_config"]))
    return family, family.config_to_diffusers(config), state


def checkpoint_adapters(model_dir: str | Path, lora, *, shadow: str | None = None) -> dict:
    """The LoRA adapters (``LoRASettings`` ``lora``) of a megatron dist checkpoint as a PEFT-named state dict
    (``<module>.lora_A.weight`` ...); ValueError names the first adapter tensor the settings and the
    checkpoint disagree on."""
    from megaflow.models.common.lora_map import lora_weight_map
    from megaflow.models.registry import get_family
    from megaflow.trainer.checkpoint import load_full_state_dict

    meta, full = load_full_state_dict(model_dir, shadow=shadow)
    family = get_family(meta["family"])
    config = family.config_from_diffusers(meta["diffusers_config"])
    adapters = {k: v for k, v in full.items() if k.endswith(ADAPTER_SUFFIXES)}
    return lora_weight_map(family.weight_map, lora).to_diffusers(adapters, config)


def save_transformer_weights(directory: Path, state: dict) -> Path:
    """Write ``state`` as the single ``diffusion_pytorch_model.safetensors`` of a diffusers model dir."""
    from safetensors.torch import save_file

    path = directory / WEIGHTS_FILE
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


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
    """Copy the pipeline into ``dst`` without the transformer's weight files (config.json kept)."""
    def skip(directory: str, names: list[str]) -> list[str]:
        if Path(directory).resolve() != (pipeline / "transformer").resolve():
            return []
        return [n for n in names if n.endswith(_WEIGHT_SUFFIXES)]

    shutil.copytree(pipeline, dst, ignore=skip)


def export_run(run_dir: str | Path, out: str | Path, iteration: int | None = None, *, ema: bool = True) -> dict:
    """Write the run's pipeline with the weights of checkpoint ``iteration`` (None = the latest) to
    ``out``: the EMA of the trained weights when the run kept one (``train.ema_decay`` > 0) and ``ema``, else
    the trained weights; returns what was written (iteration, paths, tensor count, which weights, seconds)."""
    started = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ValueError(f"--run {run_dir}: no such directory")
    pipeline = run_pipeline(run_dir)
    it, ckpt = find_checkpoint(run_dir, iteration)
    _check_out(out)

    tconfig = json.loads((pipeline / "transformer" / "config.json").read_text())
    lora, shadow = _run_settings(run_dir, ema)
    family, _, state = checkpoint_transformer(ckpt / MODEL_DIR, shadow=shadow)
    if tconfig.get("_class_name") != family.diffusers_class:
        raise ValueError(f"{ckpt / MODEL_DIR} holds a {family.diffusers_class} ({family.name}) but "
                         f"{pipeline}/transformer is a {tconfig.get('_class_name')}")
    try:
        check_diffusers_state(state, diffusers_shapes(family, tconfig))
    except ValueError as e:
        raise ValueError(f"{ckpt / MODEL_DIR} does not fit {pipeline}/transformer: {e}") from None

    adapters = checkpoint_adapters(ckpt / MODEL_DIR, lora, shadow=shadow) if lora is not None else None

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _copy_pipeline(pipeline, tmp)
        save_transformer_weights(tmp / "transformer", state)
        if adapters is not None:
            from megaflow.models.common.lora_files import write_adapter
            pipeline_class = json.loads((pipeline / "model_index.json").read_text())["_class_name"]
            write_adapter(tmp, adapters, rank=lora.rank, alpha=lora.alpha, pipeline_class=pipeline_class)
        _check_out(out)  # still free (nothing appeared while we wrote)
        tmp.rename(out)  # onto an empty dir: replaced atomically
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "iteration": it, "checkpoint": str(ckpt), "pipeline": str(pipeline),
            "family": family.name, "tensors": len(state), "lora_tensors": len(adapters or {}),
            "weights": shadow or "trained",
            "seconds": round(time.perf_counter() - started, 3)}


def _run_settings(run_dir: Path, ema: bool):
    """(the run's LoRA settings or None for a full-parameter run, "ema" when its EMA is to be exported or None),
    from its config.toml."""
    from megaflow.config import load_config
    from megaflow.trainer.settings import lora_settings
    cfg = load_config(run_dir / "config.toml")
    return lora_settings(cfg), "ema" if ema and cfg.train.ema_decay > 0 else None
