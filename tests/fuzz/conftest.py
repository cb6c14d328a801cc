"""Hypothesis profiles of the fuzz targets (tests/fuzz/README.md).

HYPOTHESIS_PROFILE picks one:

- "ci" (the default; `make test` and CI): few examples per target, derandomized (each
  target's examples follow from a hash of the test, so every run and every machine tries
  the same inputs) and no example database: a failure reproduces anywhere with the same
  hypothesis version and code. The whole directory takes seconds. (hypothesis still
  keeps a cache of the code's constants in .hypothesis/, which git ignores.)
- "fuzz" (`make fuzz`): NRI_ACCEL_FUZZ_EXAMPLES examples per target (default 10000),
  random seeds, failing examples kept in .hypothesis/ (ignored by git) and replayed
  first on the next run; `make fuzz` adds --hypothesis-show-statistics.

No deadline in either: the targets read files and the machine may be loaded, and speed
is the benchmarks' business (DESIGN.md, convention 10), not a test's.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "HYPOTHESIS_PROFILE"
EXAMPLES_ENV = "NRI_ACCEL_FUZZ_EXAMPLES"

settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get(EXAMPLES_ENV) or 10000),
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get(PROFILE_ENV) or "ci")
