"""kvtier inside vLLM (0.32 and 0.33): an offloading spec, and secondary tiers for vLLM's own tiering.

``spec_name = "KVTierOffloadingSpec"``, ``spec_module_path = "offload.vllm"`` in
``kv_connector_extra_config`` (see ``offload.vllm.spec``). Importing this package imports
vLLM; kvtier's core never does.
"""

# First: an unsupported vLLM is one clear error, not an ImportError of some missing name.
import offload.vllm.compat  # noqa: F401  # isort: skip
from offload.vllm.spec import KVTierOffloadingSpec

__all__ = ["KVTierOffloadingSpec"]
