"""`python -m hlm_ray.gpu_check`: see the package docstring."""

import sys

from hlm_ray.gpu_check import main

sys.exit(main())
