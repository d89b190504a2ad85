"""Parallel degrees (TP/PP/CP/SP/VPP, DP derived): ``ParallelDims`` is the one object that knows the layout and
checks its rules (docs/design/parallel.md). Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """Model-parallel degrees; the data-parallel degree is what the world size leaves over."""

    tp: int = 1
    """Tensor-parallel degree (heads / MLP hidden split across ranks)."""
    pp: int = 1
    """Pipeline-parallel degree (layers split into stages)."""
    cp: int = 1
    """Context-parallel degree (sequence split for attention)."""
    sp: bool = False
    """Sequence parallelism over the TP group (activations outside attention/MLP split on seq)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None = plain 1F1B."""

    def __post_init__(self):
        for name in ("tp", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be an int >= 1, got {value!r}")
        if self.sp and self.tp == 1:
            raise ValueError(f"parallel.sp = true requires parallel.tp > 1 (got tp = {self.tp})")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(f"parallel.vpp must be None (0 in a config) or an int >= 1, got {self.vpp!r}")
            if self.pp == 1:
                raise ValueError(f"parallel.vpp = {self.vpp} requires parallel.pp > 1")

    @classmethod
    def of(cls, section) -> ParallelDims:
        """The layout of a config's ``[parallel]`` section (``vpp`` 0 = off)."""
        return cls(tp=section.tp, pp=section.pp, cp=section.cp, sp=section.sp, vpp=section.vpp or None)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def num_stages(self) -> int:
        """Model chunks a block list is split into: pp * vpp."""
        return self.pp * (self.vpp or 1)

    def dp_for(self, world_size: int, *, ranks: str | None = None) -> int:
        """Data-parallel degree of ``world_size`` trainer ranks; ValueError when tp * pp * cp does not divide
        them (``ranks`` says what they are in the message, e.g. "the 3 launched process(es) (WORLD_SIZE)")."""
        size = self.model_parallel_size
        if world_size < 1 or world_size % size:
            raise ValueError(f"parallel.tp * pp * cp = {size} does not divide {ranks or f'world_size={world_size}'}; "
                             f"launch a multiple of {size} trainer processes")
        return world_size // size

    def check_model(self, heads: int | None, blocks: int | None, where: str,
                    keys: tuple[str, str] = ("parallel.tp", "parallel.pp")) -> None:
        """ValueError unless TP divides the ``heads`` attention heads and PP (x VPP) the ``blocks`` transformer
        blocks of the model ``where`` names (None: not known, not checked); ``keys``: how the message names them."""
        if heads is not None and heads % self.tp:
            raise ValueError(f"{keys[0]} = {self.tp} does not divide the {heads} attention heads of {where}")
        if blocks is not None and blocks % self.num_stages:
            raise ValueError(f"{keys[1]} = {self.pp}{f' x vpp = {self.vpp}' if self.vpp else ''} does not divide "
                             f"the {blocks} blocks of {where}")
