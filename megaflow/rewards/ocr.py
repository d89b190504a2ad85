"""OCR reward: how closely the text read from an image matches the target: ``metadata[key]``, else the prompt's
first double-quoted text; neither raises (masked). Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence

import numpy as np
import torch
from rapidfuzz.distance import Levenshtein

from megaflow.rewards.base import ImageBatch, Reward, to_uint8

_ENGINES: dict[int, object] = {}
_LOCK = threading.Lock()


def normalise(text: str) -> str:
    """Lowercase, whitespace removed: the form both the target and the recognised text are compared in."""
    return "".join(text.lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each costing 1) between ``a`` and ``b`` (rapidfuzz)."""
    return Levenshtein.distance(a, b)


def text_score(recognised: str, target: str) -> float:
    """``max(0, 1 - levenshtein / len(target))`` on the normalised strings; ValueError for an empty target."""
    rec, tgt = normalise(recognised), normalise(target)
    if not tgt:
        raise ValueError(f"ocr: empty target text {target!r}")
    return max(0.0, 1.0 - levenshtein(rec, tgt) / len(tgt))


def target_text(prompt: str, metadata: dict | None, key: str = "text") -> str:
    """The text a sample should show: ``metadata[key]``, else the prompt's first double-quoted span."""
    if metadata and key in metadata:
        value = metadata[key]
        if not isinstance(value, str):
            raise ValueError(f"ocr: metadata[{key!r}] must be a string, got {type(value).__name__}")
        text = value
    else:
        parts = prompt.split('"')
        if len(parts) < 3:
            raise ValueError(f"ocr: no double-quoted text in prompt {prompt!r} and no metadata[{key!r}]")
        text = parts[1]
    if not normalise(text):
        raise ValueError(f"ocr: empty target text {text!r} (prompt {prompt!r})")
    return text


def _engine(threads: int):
    """The process's RapidOCR engine for ``threads`` ONNX Runtime threads (built on first use)."""
    with _LOCK:
        if threads not in _ENGINES:
            from rapidocr_onnxruntime import RapidOCR
            _ENGINES[threads] = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1,
                                         det_use_cuda=False, cls_use_cuda=False, rec_use_cuda=False)
        return _ENGINES[threads]


def read_text(image: np.ndarray, *, threads: int = 1) -> str:
    """Every line RapidOCR reads in one uint8 RGB image [H, W, 3], concatenated ("" when none)."""
    engine = _engine(threads)
    bgr = np.ascontiguousarray(image[..., ::-1])  # RapidOCR takes arrays as OpenCV BGR
    with _LOCK:
        result, _ = engine(bgr)
    return "".join(line[1] for line in result) if result else ""


class OcrReward(Reward):
    """Per-image OCR match score in [0, 1] (see the module's design notes); ``key`` names the metadata field that
    overrides the prompt's quoted text, ``threads`` the ONNX Runtime intra-op threads (default 1)."""

    name = "ocr"

    def __init__(self, *, key: str = "text", threads: int = 1):
        if not isinstance(key, str) or not key:
            raise ValueError(f"reward 'ocr': key must be a non-empty string, got {key!r}")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"reward 'ocr': threads must be an integer >= 1, got {threads!r}")
        if importlib.util.find_spec("rapidocr_onnxruntime") is None:
            raise ValueError("reward 'ocr' needs rapidocr-onnxruntime (installed by scripts/setup_env.sh)")
        self.key, self.threads = key, threads

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        meta = list(metadata) if metadata is not None else [{} for _ in prompts]
        targets = [target_text(p, m, self.key) for p, m in zip(prompts, meta)]  # bad prompts fail before OCR
        scores = [text_score(read_text(img, threads=self.threads), t) for img, t in zip(to_uint8(images), targets)]
        return torch.tensor(scores, dtype=torch.float32)
