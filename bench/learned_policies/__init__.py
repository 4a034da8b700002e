"""Learned-model policies, kept as benchmark references beside Belady's OPT and the index bound.

``lhd`` (least hit density, after LHD, NSDI'18) and ``hazard`` (hit density learned from
the whole key stream, evicted keys' returns included) rank sampled chain tails by a model
of reuse learned online. They were kvtier policies; they left ``policies/`` because
neither earns a place on vLLM's scheduler thread (docs/policies.md#learned-policies-are-benchmark-references):

- ``hazard`` runs at 0.19x vLLM ``arc``'s calls/s as vLLM drives it, and the work it does
  besides evicting (its per-event model) would hold it near 0.5x even if eviction cost
  nothing; its gain there, +5.1% over vLLM ``arc`` on the production trace at host 10%, is
  not robust (5% and 13% under vLLM ``arc`` on two trace shapes it was not tuned on);
- ``lhd`` runs at 0.6x and ends 2.1% under vLLM ``arc`` in the same cell.

What they still answer is how far a learned model of reuse goes on a trace, so
``kvtier bench policy`` and ``bench.index_bound`` run them by name: importing ``bench``
registers them (``policies.registry.register_policy``). Outside the benchmark a
configuration can still name one by its class path, which the error for its bare name gives
(``policies.registry.MOVED_TO_BENCH``).
"""

from __future__ import annotations

from bench.learned_policies.hazard import ReuseHazardPolicy
from bench.learned_policies.hit_density import HitDensityPolicy
from policies.registry import register_policy

LEARNED_POLICIES = (HitDensityPolicy.name, ReuseHazardPolicy.name)
"""Their names, in the order benchmarks list them."""

for _cls in (HitDensityPolicy, ReuseHazardPolicy):
    register_policy(_cls)
