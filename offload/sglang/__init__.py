"""kvtier as SGLang's HiCache storage backend: ``module_path`` ``offload.sglang``,
``class_name`` ``KVTierStorage`` in SGLang's ``dynamic`` backend config (see
``offload.sglang.backend`` and docs/sglang.md). Importing it imports SGLang where SGLang is
installed; kvtier imports it nowhere else."""

from offload.sglang.backend import KVTierStorage, page_key

__all__ = ["KVTierStorage", "page_key"]
