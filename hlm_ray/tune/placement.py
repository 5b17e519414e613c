"""How many trials of a sweep fit on the cluster at once, placing whole workers on nodes.

concurrency = plan_concurrency(spec, num_trials, [n["Resources"] for n in alive_nodes()])
"""

from __future__ import annotations

import math

from hlm_ray.errors import HLMError
from hlm_ray.tune.spec import SweepSpec


def plan_concurrency(spec: SweepSpec, num_trials: int, nodes: list[dict[str, float]]) -> int:
    """Trials that fit side by side on the cluster (`nodes`: each alive node's resources), or
    an HLMError when one trial can never be placed."""
    need_cpu = spec.workers_per_trial * spec.cpus_per_worker
    need_gpu = spec.workers_per_trial * spec.gpus_per_worker
    total_cpu = sum(n.get("CPU", 0.0) for n in nodes)
    total_gpu = sum(n.get("GPU", 0.0) for n in nodes)
    hint = "lower --workers-per-trial, --cpus-per-worker or --gpus-per-worker"
    if not any(n.get("CPU", 0.0) >= spec.cpus_per_worker for n in nodes):
        biggest = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
        raise HLMError(
            f"a worker needs {spec.cpus_per_worker:g} CPUs but the largest node has "
            f"{biggest:g}; {hint}"
        )
    if need_cpu > total_cpu + 1e-9:
        raise HLMError(
            f"a trial needs {spec.workers_per_trial} worker(s) × {spec.cpus_per_worker:g} CPU = "
            f"{need_cpu:g} CPUs but the cluster has {total_cpu:g}; {hint}"
        )
    if spec.gpus_per_worker and not any(n.get("GPU", 0.0) >= spec.gpus_per_worker for n in nodes):
        raise HLMError(
            f"a worker needs {spec.gpus_per_worker:g} GPU(s) but the cluster has "
            f"{total_gpu:g} GPU(s) (none on one node); {hint}, or --gpus-per-worker 0"
        )
    if need_gpu > total_gpu + 1e-9:
        raise HLMError(
            f"a trial needs {spec.workers_per_trial} worker(s) × {spec.gpus_per_worker:g} GPU = "
            f"{need_gpu:g} GPUs but the cluster has {total_gpu:g}; {hint}"
        )
    # Workers are placed whole on a node: count the workers each node holds, not the cluster's
    # total (three 3-CPU nodes hold three 2-CPU workers, not four).
    slots = sum(_workers_on(node, spec) for node in nodes)
    if slots < spec.workers_per_trial:
        raise HLMError(
            f"a trial needs {spec.workers_per_trial} worker(s) of {spec.cpus_per_worker:g} CPU"
            f"{f' and {spec.gpus_per_worker:g} GPU' if spec.gpus_per_worker else ''} but the "
            f"cluster's nodes hold {slots} such worker(s); {hint}"
        )
    return max(1, min(slots // spec.workers_per_trial, num_trials))


def _workers_on(node: dict[str, float], spec: SweepSpec) -> int:
    """How many of one trial's workers fit on `node` at once."""
    fits = math.floor(node.get("CPU", 0.0) / spec.cpus_per_worker + 1e-9)
    if spec.gpus_per_worker:
        fits = min(fits, math.floor(node.get("GPU", 0.0) / spec.gpus_per_worker + 1e-9))
    return fits
