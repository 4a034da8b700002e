"""kvtier's benchmarks. Importing the package registers the learned-model policies they
compare against (``bench.learned_policies``)."""

import bench.learned_policies  # noqa: F401  (registers lhd and hazard by name)
