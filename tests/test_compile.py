"""optim.compile: the training step's objective under torch.compile trains as eager does.

The aot_eager backend (dynamo's graph capture and AOT autograd, no code generation) keeps this
under ~40 s on 2 cores; inductor took 86 s for both objectives. Inductor's numerics are checked
on the CWT loss in tests/test_fused_ce.py.
"""

import pytest
import torch._dynamo

from hlm_ray.paths import data_dir
from hlm_ray.presets import load_config
from hlm_ray.tracking import read_metrics
from hlm_ray.train.loop import train_worker

SHAKESPEARE = str(data_dir() / "corpus" / "en" / "tinyshakespeare.txt")


def _losses(out, **extra):
    overrides = {
        "data.sources": [SHAKESPEARE],
        "tokenizer.vocab_size": 300,
        "optim.max_steps": 6,
        "optim.warmup_steps": 1,
        "optim.micro_batch_size": 4,
        "optim.global_batch_size": 4,
        "data.seq_len": 32,
        "run.output_dir": str(out),
        "run.log_every": 1,
        "run.eval_every": 6,
        "run.checkpoint_every": 6,
        **extra,
    }
    cfg = load_config("tiny-decoder", objective="headless", overrides=overrides)
    train_worker(cfg.to_dict(), progress=False)
    return [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]


@pytest.mark.parametrize("objective", ["headless", "vanilla"])
def test_compiled_step_trains_like_eager(objective, tmp_path, monkeypatch):
    monkeypatch.setenv("HLM_COMPILE_BACKEND", "aot_eager")
    eager = _losses(tmp_path / "eager", **{"objective.name": objective})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _losses(
        tmp_path / "compiled", **{"objective.name": objective, "optim.compile": True}
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert len(eager) == 6 and eager[-1] < eager[0]
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-4)
