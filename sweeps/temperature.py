"""The CWT temperature τ (`objective.temperature`): loss_i = -log softmax(O Eᵀ / τ)[i, i].

    python sweeps/temperature.py --preset tiny        # tiny headless encoders, 2 values, 2 CPUs
    python sweeps/temperature.py --preset paper       # BERT-Small on CC-News, GPU workers
    python sweeps/temperature.py --set sweep.values=[0.05,0.2,1.0]

Every published headless run used τ = 1 (a plain dot product of hidden state and input
embedding); this sweep asks whether that choice matters. Headless encoders only (τ does not
enter the cross-entropy of a vanilla model), scored by the GLUE-style fine-tuning average as in
the vocabulary sweep.
"""

import sys

from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import sweep_main
from hlm_ray.tune.spec import CC_NEWS, TINY_TRIAL, SweepSpec

AXIS = Axis(
    name="temperature",
    field="objective.temperature",
    short="t",
    label="CWT temperature τ",
    column=("τ", "temperature"),
    figures=(
        Figure("temperature_score.png", "downstream/score", "downstream score"),
        Figure("temperature_loss.png", "loss", "validation CWT loss (depends on τ)"),
    ),
    description="The CWT temperature as a Ray Tune sweep (headless encoders).",
)

PRESETS = {
    "tiny": SweepSpec(
        axis=AXIS,
        base="tiny-encoder",
        values=(0.1, 1.0),
        objectives=("headless",),
        overrides=TINY_TRIAL,
        recipe="tiny",
    ),
    "paper": SweepSpec(
        axis=AXIS,
        base="bert-small",
        values=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
        objectives=("headless",),
        overrides=(CC_NEWS, "tokenizer.train_sample_bytes=1000000000"),
        recipe="paper",
        cpus_per_worker=4,
        gpus_per_worker=1,
    ),
}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the sweep with command-line `argv` (`hlm sweep` passes its own `prog`)."""
    return sweep_main(AXIS, PRESETS, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
