"""`python -m hlm_ray.bench --preset cpu`: the same as `hlm bench` (e.g. inside a Ray job)."""

import sys

from hlm_ray.bench.cli import main

sys.exit(main())
