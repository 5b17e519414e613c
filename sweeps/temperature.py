"""The CWT temperature τ (`objective.temperature`): loss_i = -log softmax(O Eᵀ / τ)[i, i].

    python sweeps/temperature.py --preset tiny        # tiny headless encoders, 2 values, 2 CPUs
    python sweeps/temperature.py --preset paper       # BERT-Small on CC-News, GPU workers
    python sweeps/temperature.py --set sweep.values=[0.05,0.2,1.0]

Every published headless run used τ = 1 (a plain dot product of hidden state and input
embedding); this sweep asks whether that choice matters. Headless encoders only (τ does not
enter the cross-entropy of a vanilla model), scored by the GLUE-style fine-tuning average as in
the vocabulary sweep.

This file is the model of a new ablation: an `Axis` (the config field it varies, how its values
are shown), its presets, and `SweepScript` for the command line, the summary and the figures.
"""

import sys

from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.spec import paper_scale, tiny_scale

AXIS = Axis(
    name="temperature",  # sweeps/temperature.py; runs/sweeps/temperature-<preset>
    field="objective.temperature",  # the config field a value sets
    label="CWT temperature τ",  # the figures' x axis
    column=("τ", "temperature"),  # the value's column in summary.md, summary.csv
    figures=(
        Figure("temperature_score.png", "downstream/score", "downstream score"),
        Figure("temperature_loss.png", "loss", "validation CWT loss (depends on τ)"),
    ),
    description="The CWT temperature as a Ray Tune sweep (headless encoders).",
)

HEADLESS = ("headless",)  # τ does not enter a vanilla model's loss
PRESETS = {
    "tiny": tiny_scale(AXIS, "tiny-encoder", (0.1, 1.0), objectives=HEADLESS),
    "paper": paper_scale(
        AXIS,
        "bert-small",
        (0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
        "tokenizer.train_sample_bytes=1000000000",
        objectives=HEADLESS,
    ),
}

SCRIPT = SweepScript(AXIS, PRESETS)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
