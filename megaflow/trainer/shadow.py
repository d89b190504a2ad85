"""Shadow weights: fp32 copies of a trainer's trainable parameter shards, blended toward the live ones.
Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["EMA", "ShadowWeights", "ema_decay_at", "trainable_parameters"]


def trainable_parameters(chunks: list[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters of ``chunks`` by ``<chunk index>.<name>`` (frozen LoRA bases left out)."""
    return {f"{i}.{name}": p for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()
            if p.requires_grad}


def ema_decay_at(decay: float, step: int) -> float:
    """The EMA decay of the blend after optimizer step ``step`` (counted from 1, this step included):
    min(decay, (1 + step) / (10 + step))."""
    return min(decay, (1 + step) / (10 + step))


class ShadowWeights:
    """fp32 copies of ``params`` (name -> live parameter), initialised to their current values."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        if not params:
            raise ValueError("ShadowWeights needs at least one trainable parameter")
        self._params = params
        self.tensors = {name: p.detach().float().clone() for name, p in params.items()}
        self.num_updates = 0
        """Optimizer steps followed so far (the EMA warm-up and θ_old's schedule read it; checkpoints keep it)."""
        self._set_from_live: dict | None = self._versions()
        """The live and shadow tensors' version counters when the shadow was last set to the live values; None
        after a blend that mixed, or a load."""

    def _versions(self) -> dict[str, tuple[int, int, int]]:
        return {n: (p._version, id(self.tensors[n]), self.tensors[n]._version) for n, p in self._params.items()}

    def equals_live(self) -> bool:
        """The shadow holds the live weights bit for bit: it was set from them (at creation, by a blend with decay
        0) and neither a live parameter nor a shadow tensor has changed since (torch's version counters count every
        in-place write: an optimizer step, a load, ``applied``)."""
        return self._set_from_live is not None and self._set_from_live == self._versions()

    @classmethod
    def of(cls, chunks: list[torch.nn.Module]) -> ShadowWeights:
        return cls(trainable_parameters(chunks))

    @torch.no_grad()
    def blend(self, decay: float, steps: int = 1) -> None:
        """shadow ← decay·shadow + (1 − decay)·live; decay 0 copies the live weights exactly; ``steps``: the
        optimizer steps this blend follows (added to ``num_updates``)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        names = list(self.tensors)
        live = [self._params[n].detach().float() for n in names]
        shadow = [self.tensors[n] for n in names]
        if decay == 0.0:
            torch._foreach_copy_(shadow, live)
        elif decay < 1.0:
            torch._foreach_lerp_(shadow, live, 1.0 - decay)
        self._set_from_live = self._versions() if decay == 0.0 else None
        self.num_updates += steps

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The live parameters hold the shadow inside the block; their own values return exactly after it."""
        with torch.no_grad():
            stash = {n: p.detach().clone() for n, p in self._params.items()}
            for n, p in self._params.items():
                p.copy_(self.tensors[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self._params.items():
                    p.copy_(stash[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shadow tensors by name plus ``num_updates`` (a 0-dim int64 tensor): what a checkpoint keeps."""
        return {**self.tensors, "__num_updates__": torch.tensor(self.num_updates, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from ``state_dict``; ValueError names the first missing, unexpected or mis-shaped tensor."""
        names = set(state) - {"__num_updates__"}
        if names != set(self.tensors):
            missing, extra = sorted(set(self.tensors) - names), sorted(names - set(self.tensors))
            raise ValueError(f"shadow weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for n, t in self.tensors.items():
            if tuple(state[n].shape) != tuple(t.shape):
                raise ValueError(f"shadow tensor {n!r}: shape {tuple(state[n].shape)}, the model's is {tuple(t.shape)}")
            t.copy_(state[n])
        self.num_updates = int(state["__num_updates__"])
        self._set_from_live = None


class EMA(ShadowWeights):
    """The EMA of θ: ``step()`` after every optimizer step blends with ``ema_decay_at(decay, num_updates + 1)``."""

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay!r}")
        super().__init__(params)
        self.decay = decay

    @classmethod
    def of(cls, chunks: list[torch.nn.Module], decay: float) -> EMA:  # type: ignore[override]
        return cls(trainable_parameters(chunks), decay)

    def step(self) -> None:
        self.blend(ema_decay_at(self.decay, self.num_updates + 1))
