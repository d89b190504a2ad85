"""In an SGLang engine worker: how the weights it holds are hashed, and an update checked in the same request.
Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

CHECKSUM_VAR = "MEGAFLOW_SGLANG_CHECKSUM"
HASH_TARGET = "sglang.multimodal_gen.runtime.post_training.tensor_update_checker.compute_tensor_sha256"
DIGESTS_KEY = "megaflow_expected_digests"
"""Module-payload key: {tensor name: digest} of the bucket's tensors, hashed by the sender."""
UPDATE_TARGET = "sglang.multimodal_gen.runtime.post_training.weights_updater.WeightsUpdater.update_weights_from_tensor"
COPY_TARGET = "sglang.multimodal_gen.runtime.post_training.weights_updater.load_weights_into_model"
VERIFY_TARGET = "sglang.multimodal_gen.runtime.post_training.tensor_update_checker.TensorUpdateChecker.verify"


@dataclass
class _Check:
    module: str
    expected: dict[str, str]
    actual: dict[str, str] = field(default_factory=dict)


_current: _Check | None = None
"""The update being checked (a worker runs one update at a time, on its scheduler thread)."""


def _algorithm() -> str:
    from megaflow.checksum import DEFAULT

    return os.environ.get(CHECKSUM_VAR) or DEFAULT


def tensor_digest(tensor) -> str:
    """In place of SGLang's ``compute_tensor_sha256``: megaflow's digest (``CHECKSUM_VAR``'s algorithm, default
    xxh3; on a GPU ``checksum.device_digest``), hashed from the tensor's own bytes."""
    from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import _materialize_local_tensor

    from megaflow.checksum import tensor_digest as digest

    return digest(_materialize_local_tensor(tensor), _algorithm())


def _take_digests(named_tensors) -> tuple[str, dict[str, str]] | None:
    """(module name, digests) popped from the one module payload that carries them, or None."""
    if not isinstance(named_tensors, dict):
        return None
    for module, payload in named_tensors.items():
        if isinstance(payload, dict) and payload.get(DIGESTS_KEY) is not None:
            return module, dict(payload.pop(DIGESTS_KEY))
    return None


def check_update(original, updater, named_tensors, *args, **kwargs) -> tuple[bool, str]:
    """Around ``WeightsUpdater.update_weights_from_tensor``: the update, then its check against the payload's
    digests (when it carries them)."""
    global _current
    carried = _take_digests(named_tensors)
    if carried is None:
        return original(updater, named_tensors, *args, **kwargs)
    from sglang.multimodal_gen.runtime.distributed import get_world_group

    if get_world_group().world_size > 1:
        return False, "an update that carries digests needs a single-rank engine (use a separate check request)"
    _current = check = _engine_names(updater, _Check(*carried))
    try:
        ok, message = original(updater, named_tensors, *args, **kwargs)
    finally:
        _current = None
    if not ok:
        return ok, message
    return _compare(updater, check, message)


def _engine_names(updater, check: _Check) -> _Check:
    """The check keyed by the engine's parameter names (``engine_names``)."""
    module = updater.pipeline.get_module(check.module)
    return _Check(check.module, engine_names(module, check.expected)) if module is not None else check


def engine_names(module, named: dict[str, str]) -> dict[str, str]:
    """``named`` keyed by ``module``'s own parameter names: a name the module does not hold goes through its
    ``param_names_mapping`` (SGLang's Wan DiT: diffusers' ``blocks.0.attn1.to_q`` is ``blocks.0.to_q``), as an update
    maps it; parts of a fused parameter keep their names."""
    from sglang.multimodal_gen.runtime.post_training.weights_updater import _build_module_weight_name_mapper

    map_name = _build_module_weight_name_mapper(module)
    if map_name is None:
        return dict(named)
    held = set(dict(module.named_parameters())) | set(dict(module.named_buffers()))
    out = {}
    for name, value in named.items():
        mapped, merge_index = (name, None) if name in held else map_name(name)
        out[mapped if merge_index is None and mapped in held else name] = value
    return out


def verify_engine_names(original, checker, target_module, expected_named_tensors_sha256, *args, **kwargs):
    """Around SGLang's ``TensorUpdateChecker.verify`` (a check request): the expected digests by the module's own
    parameter names (``engine_names``), so a check by diffusers names finds the tensors an update by them loaded."""
    module = checker.pipeline.get_module(target_module)
    if module is not None:
        expected_named_tensors_sha256 = engine_names(module, expected_named_tensors_sha256)
    return original(checker, target_module, expected_named_tensors_sha256, *args, **kwargs)


def _compare(updater, check: _Check, message: str) -> tuple[bool, str]:
    bad = sorted(n for n, d in check.actual.items() if check.expected.get(n) != d)
    if bad:
        return False, (f"weights not verified after update: {len(bad)} tensor(s) differ from what was sent: "
                       f"{', '.join(bad[:5])}")
    rest = {n: d for n, d in check.expected.items() if n not in check.actual}
    if rest:
        from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import TensorUpdateChecker

        ok, detail = TensorUpdateChecker(updater.pipeline).verify(check.module, rest)
        if not ok:
            return False, f"weights not verified after update: {detail}"
    return True, f"{message} Verified {len(check.expected)} tensor(s) as loaded."


def hash_as_copied(original, weights_iter, model_params, *args, **kwargs):
    """Around SGLang's ``load_weights_into_model``: during a checked update, a plain host parameter (no loader, same
    shape and dtype) is copied here, a chunk at a time, each chunk hashed just after it is written
    (``checksum.copy_hashed``); any other named parameter is hashed once SGLang has copied into it (its next entry
    is asked for after the copy)."""
    check = _current
    if check is None:
        return original(weights_iter, model_params, *args, **kwargs)

    def entries():
        copied = None
        for entry in weights_iter:
            _record(check, copied, model_params)
            copied = None
            if not _copy_checked(check, entry, model_params):
                copied = entry
                yield entry
        _record(check, copied, model_params)
    return original(entries(), model_params, *args, **kwargs)


def _copy_checked(check: _Check, entry, model_params) -> bool:
    """Copy and hash ``entry`` here when its parameter is one SGLang would fill by a plain ``copy_`` (True)."""
    import torch

    from megaflow.checksum import WSUM, copy_hashed

    name, weight, *shard = entry
    param = model_params.get(name) if name in check.expected and not (shard and shard[0] is not None) else None
    data = getattr(param, "data", None)
    if (data is None or callable(getattr(param, "weight_loader", None)) or type(data) is not torch.Tensor
            or check.expected[name].startswith(WSUM) or data.device.type != "cpu" or weight.device.type != "cpu"
            or data.dtype != weight.dtype or data.shape != weight.shape or not data.is_contiguous()):
        return False
    check.actual[name] = copy_hashed(data, weight, _algorithm())
    return True


def _record(check: _Check, entry, model_params) -> None:
    if entry is None:
        return
    name, _, *shard = entry
    if name in check.expected and name in model_params and not (shard and shard[0] is not None):
        from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import _materialize_local_tensor

        from megaflow.checksum import digest_like

        check.actual[name] = digest_like(_materialize_local_tensor(model_params[name]), check.expected[name],
                                         _algorithm())
