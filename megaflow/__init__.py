"""megaflow: FlowGRPO post-training of flow-matching diffusion transformers.

megatron-core trains the DiT, an embedded SGLang diffusion engine samples rollouts, and a
weight-update bridge streams trainer weights into the engine.
"""
from megaflow._env import ignore_terminal_interrupt_in_engine_workers, install_import_guards, memoize_package_index

__version__ = "0.1.0"

install_import_guards()
memoize_package_index()
ignore_terminal_interrupt_in_engine_workers()
