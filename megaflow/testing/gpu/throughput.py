"""The arithmetic of the SD3.5-M RL throughput table (standard library only): model FLOPs, MFU, images/GPU/s.
Invariant: model FLOPs count what the model needs, not what the hardware ran (docs/design/testing.md).
"""
from __future__ import annotations

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12}
"""Dense bf16 tensor-core peak (FLOP/s, no sparsity) by the device name's model; the SXM parts' datasheet figures."""


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Datasheet peak FLOP/s of the device named ``device_name`` (e.g. 'NVIDIA H100 80GB HBM3'); None if unknown or
    not bf16 (fp32 MFU is not reported)."""
    if dtype != "bf16":
        return None
    for model, flops in PEAK_BF16_FLOPS.items():
        if model in device_name.split() or any(w.startswith(model) for w in device_name.split()):
            return flops
    return None


def attention_flops(tokens: int, hidden: int) -> float:
    """Q K^T and (softmax) V over ``tokens`` tokens: 2 products of 2 * L^2 * hidden FLOPs."""
    return 4.0 * tokens * tokens * hidden


def forward_flops(d, image: int, text: int) -> float:
    """Model FLOPs of one DiT forward for ``image`` + ``text`` tokens (``d``: a DiTDims): the patch, text and final
    projections; each joint block 12h^2 per token and stream (the last one's text stream only q/k/v, 3h^2, when
    ``context_pre_only_last``: SD3) and joint attention, plus SD3.5's second image attention on the first
    ``dual_blocks``; each single-stream block (FLUX: qkv 3h^2, MLP in 4h^2, output over attention + MLP 5h^2: 12h^2)
    and attention on image + text."""
    h, tokens = d.hidden, image + text
    total = 2.0 * image * d.in_channels * d.patch ** 2 * h + 2.0 * text * d.joint_dim * h
    total += 2.0 * image * h * d.patch ** 2 * d.out_channels
    for i in range(d.blocks):
        last = d.context_pre_only_last and i == d.blocks - 1
        total += 2.0 * image * 12 * h * h + 2.0 * text * (3 if last else 12) * h * h
        total += attention_flops(tokens, h)
        if i < d.dual_blocks:
            total += 2.0 * image * 4 * h * h + attention_flops(image, h)
    total += d.single_blocks * (2.0 * tokens * 12 * h * h + attention_flops(tokens, h))
    return total


def train_step_flops(d, image: int, text: int, batch: int) -> float:
    """Model FLOPs of one train step (forward + backward = 3 forwards) over ``batch`` samples."""
    return 3.0 * batch * forward_flops(d, image, text)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model-FLOPs utilisation: ``flops`` done in ``seconds`` over the ``peak`` FLOP/s (None without a peak)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak


def images_per_gpu_second(prompts: int, samples_per_prompt: int, step_seconds: float, gpus: int) -> float:
    """verl-omni's whole-loop throughput: batch x samples / (step seconds x GPUs), one step = one RL iteration
    (rollout, reward, training, weight sync)."""
    if step_seconds <= 0 or gpus < 1:
        raise ValueError(f"step_seconds must be > 0 and gpus >= 1, got {step_seconds}, {gpus}")
    return prompts * samples_per_prompt / (step_seconds * gpus)


def images_per_second(images: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return images / seconds
