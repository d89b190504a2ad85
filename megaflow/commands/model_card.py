"""The README.md model card of an export (``huggingface_hub.ModelCard``): what a user publishing it needs, read from
the run (base model, algorithm, reward, iterations, its evaluations) rather than copied from the base pipeline.
Invariant: the card states only what the run dir records (its config.toml and eval.jsonl).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

ENCODER_FILE = "encode_prompts.py"  # an SD3 export's copy of megaflow/models/sd3/text.py (torch only)
EVAL_FIGURES = ("eval/accuracy", "eval/partial_mean", "eval/reward_total", "eval/seen_accuracy")


def export_card(run_dir: Path, *, base_model: str, iteration: int, weights: str, adapters: dict | None = None,
                lora=None, prompt_length: int | None = None, lora_only: bool = False):
    """The card (a ``huggingface_hub.ModelCard``) of an export of ``run_dir``'s checkpoint ``iteration``: a whole
    pipeline, with a LoRA run's adapter beside its base weights (``adapters`` and the run's ``lora`` settings), or
    (``lora_only``) the adapter alone."""
    from huggingface_hub import ModelCard, ModelCardData

    from megaflow.config import load_config
    cfg = load_config(run_dir / "config.toml")
    tags = ["megaflow", cfg.algo.name, "text-to-image"] + (["lora"] if adapters is not None else [])
    data = ModelCardData(base_model=base_model, library_name="diffusers", tags=tags)
    kind = "LoRA adapter" if lora_only else "pipeline"
    rewards = ", ".join(f"{name} (weight {w:g})" for name, w in cfg.reward.weights.items())
    lines = [f"# {run_dir.name}: a megaflow {kind}", "",
             f"Post-trained from `{base_model}` with megaflow ({cfg.algo.name}, the {cfg.model.family} family).", "",
             f"- algorithm: `{cfg.algo.name}`; reward: {rewards}",
             f"- checkpoint iteration {iteration} of {cfg.train.iterations} ({weights} weights); "
             f"{cfg.rollout.prompts_per_iter} prompts x {cfg.rollout.group_size} samples an iteration, "
             f"{cfg.rollout.height}x{cfg.rollout.width} px, {cfg.rollout.num_steps} steps",
             *_lora_lines(lora, adapters), "", *_evaluation_lines(run_dir, iteration),
             *_usage(adapters, prompt_length, lora_only)]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _lora_lines(lora, adapters: dict | None) -> list[str]:
    if adapters is None:
        return []
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in adapters})
    return [f"- LoRA rank {lora.rank}, alpha {lora.alpha:g} (scale alpha / rank = {lora.alpha / lora.rank:g}); "
            f"targets (megatron linears): {', '.join(lora.targets)}; {len(modules)} diffusers modules"]


def _evaluation_lines(run_dir: Path, iteration: int) -> list[str]:
    """A table of the run's evaluations up to ``iteration`` (eval.jsonl), or a line saying there are none."""
    path = run_dir / "eval.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("iteration"), int) and row["iteration"] <= iteration:
                rows.append(row)
    keys = [k for k in EVAL_FIGURES if any(_number(r.get(k)) for r in rows)]
    if not keys:
        return ["The run recorded no evaluation (eval.every = 0).", ""]
    out = ["Evaluation on the run's test prompts (eval.jsonl):", "", "| iteration | " + " | ".join(keys) + " |",
           "| --- |" + " --- |" * len(keys)]
    out += [f"| {r['iteration']} | " + " | ".join(f"{r[k]:.4g}" if _number(r.get(k)) else "" for k in keys) + " |"
            for r in rows]
    return [*out, ""]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _usage(adapters: dict | None, prompt_length: int | None, lora_only: bool) -> list[str]:
    load = [f"pipe = DiffusionPipeline.from_pretrained({'BASE_PIPELINE' if lora_only else 'THIS_DIR'})"]
    if adapters is not None:  # the adapter beside the base weights
        load += ['pipe.load_lora_weights(THIS_DIR, weight_name="pytorch_lora_weights.safetensors")',
                 "# or PEFT: PeftModel.from_pretrained(pipe.transformer, THIS_DIR)  (adapter_config.json here)"]
    out = ["```python", "from diffusers import DiffusionPipeline", *load, "```"]
    if prompt_length is not None:
        out += ["", f"megaflow's engine encodes prompts to {prompt_length} tokens for every text encoder (diffusers "
                f"keeps CLIP at 77); `{ENCODER_FILE}` here (torch only, no megaflow) encodes them the same way:", "",
                "```python", "import sys; sys.path.insert(0, THIS_DIR)", "from encode_prompts import encode_prompts",
                f"embeds, pooled = encode_prompts(pipe, prompts, max_sequence_length={prompt_length})",
                "images = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=1.0).images", "```"]
    return out
