"""OpenMP's waiting policy for the commands that compute in their own process (`hlm train
--local`, `hlm finetune`, `hlm eval`, `hlm generate`, ...): threads that sleep at a barrier
instead of spinning, unless the user chose otherwise.

    from hlm_ray.threads import passive_openmp
    passive_openmp()          # before torch is imported: libgomp reads it once, as it loads

Why: torch's CPU build runs each operator on one OpenMP thread per core, and libgomp's default
is to spin (busy-wait) for a while at every barrier before sleeping. When other processes share
the cores, a thread that waits for a descheduled sibling burns the CPU time that sibling needs:
on 2 shared cores the tiny decoder's training step went from 33 ms to 409 ms, and to 2.5 s with
two busy loops beside it (`OMP_WAIT_POLICY=PASSIVE`: 33 ms and 67 ms; one thread: 37 ms and
150-180 ms). Ray Train workers run one thread each (Ray sets `OMP_NUM_THREADS=1` from their
CPUs), where the question does not arise. A user's own `OMP_WAIT_POLICY` (or `GOMP_SPINCOUNT`)
is kept, and `OMP_NUM_THREADS` sets the thread count as usual.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

WAIT_POLICY = "OMP_WAIT_POLICY"
COMMANDS = ("train", "compare", "finetune", "eval", "generate", "serve")
"""The `hlm` commands that compute in their own process (or a child of it, `hlm serve`'s
decode process): they get the passive policy. `hlm bench` keeps OpenMP's defaults: it measures
the machine as torch finds it."""


def passive_openmp(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment says how OpenMP should wait, or torch
    (and with it libgomp, which reads the variable once, as it loads) is imported already: too
    late for this process, and its environment is not this call's to change (`main` called
    from a test). Whether it was set."""
    if WAIT_POLICY in environ or "GOMP_SPINCOUNT" in environ or "torch" in sys.modules:
        return False
    environ[WAIT_POLICY] = "PASSIVE"
    return True
