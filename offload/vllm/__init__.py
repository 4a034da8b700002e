"""kvtier inside vLLM (0.33): an offloading spec, and secondary tiers for vLLM's own tiering.

``spec_name = "KVTierOffloadingSpec"``, ``spec_module_path = "offload.vllm"`` in
``kv_connector_extra_config`` (see ``offload.vllm.spec``). Importing this package imports
vLLM; kvtier's core never does.
"""

from offload.vllm.spec import KVTierOffloadingSpec

__all__ = ["KVTierOffloadingSpec"]
