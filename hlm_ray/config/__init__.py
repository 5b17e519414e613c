"""The typed config tree and how it is read: the schema, parsing and overrides, the checks.

Every entry point builds one `Config` from a preset, an optional YAML file and dotted overrides
(`hlm_ray.presets.load_config`), and validates it before any work starts. Ray and Tune carry it
as a plain dict (`to_dict` / `Config.from_dict`) and turn it back into a `Config` on the first
line of a worker.

    from hlm_ray.config import Config, apply_overrides
    cfg = apply_overrides(Config(), ["objective.name=vanilla", "optim.lr=3e-4"])
    cfg.optim.grad_accum_steps(world_size=2)   # derived from the global batch, checked
    spec = build(SweepSpec, {"values": [8, 16]}, prefix="sweep.")   # any dataclass from a dict

    schema.py   the dataclasses, one docstring a field
    parse.py    a dataclass from a dict, value coercion, dotted overrides, flatten
    checks.py   the checks that span fields (`validate`)

An invalid value raises `HLMError` naming the field, the value and what is allowed.
"""

from dataclasses import replace

from hlm_ray.config.checks import validate
from hlm_ray.config.parse import apply_overrides, build, flatten
from hlm_ray.config.schema import (
    DECODERS,
    ENCODERS,
    OBJECTIVES,
    Arch,
    BudgetConfig,
    ClassifyConfig,
    Config,
    DataConfig,
    InitConfig,
    ModelConfig,
    ObjectiveConfig,
    ObjectiveName,
    OptimConfig,
    RunConfig,
    TokenizerConfig,
)

__all__ = [
    "DECODERS",
    "ENCODERS",
    "OBJECTIVES",
    "Arch",
    "BudgetConfig",
    "ClassifyConfig",
    "Config",
    "DataConfig",
    "InitConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "ObjectiveName",
    "OptimConfig",
    "RunConfig",
    "TokenizerConfig",
    "apply_overrides",
    "build",
    "flatten",
    "replace",
    "validate",
]
