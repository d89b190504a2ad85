"""SGLang diffusion plugin (entry point in group ``sglang.multimodal_gen.plugins``, see pyproject.toml):
freeze each engine worker's heap once its scheduler is built.

SGLang's ``update_weights_from_tensor`` ends with a full ``gc.collect()``, which in a worker holding
SGLang, torch, transformers and diffusers traces millions of objects: ~0.6 s per update on CPU, measured
(py-spy: 94% of the samples of a 1.2 MB update), whatever the update's size. ``gc.freeze()`` after start
moves every object alive at that point into the permanent generation, which collections skip, so later
collections trace only what was allocated since. Objects frozen are the runtime and the loaded pipeline,
which live as long as the worker; weight updates copy into existing parameters.

The plugin acts only in processes started with ``MEGAFLOW_SGLANG_GC_FREEZE=1`` in their environment
(``EngineServer.start`` sets it while it spawns workers), so other SGLang uses of the same environment are
left alone.
"""
from __future__ import annotations

import gc
import os

ENV_VAR = "MEGAFLOW_SGLANG_GC_FREEZE"
HOOK_TARGET = "sglang.multimodal_gen.runtime.managers.scheduler.Scheduler.__init__"


def register() -> None:
    """SGLang's plugin callback: hook the scheduler's constructor (only when ``ENV_VAR`` is "1")."""
    if os.environ.get(ENV_VAR) != "1":
        return
    from sglang.multimodal_gen.runtime.platforms.plugins import plugin_hook

    plugin_hook(HOOK_TARGET)(freeze_heap)


def freeze_heap(result, *args, **kwargs) -> None:
    """After ``Scheduler.__init__``: collect once, then freeze every surviving object."""
    gc.collect()
    gc.freeze()
