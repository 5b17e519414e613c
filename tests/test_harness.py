"""lm-evaluation-harness through `hlm eval --task harness:...`: the harness's lambada_openai
agrees with hlm's own LAMBADA, offline tasks read the shipped files, missing data is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlm_ray.cli import main
from hlm_ray.errors import HLMError
from hlm_ray.evaluate.harness import harness_names, run_harness, split_tasks, task_manager
from hlm_ray.paths import has_shared, shared_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_lambada = pytest.mark.skipif(
    not has_shared("eval/lambada_openai.jsonl"), reason="needs the shipped LAMBADA file"
)


def test_split_tasks_gives_the_harness_item_the_rest_of_the_list():
    assert split_tasks("lambada, bpb") == ["lambada", "bpb"]
    assert split_tasks("lambada,harness:lambada_openai,sst2") == [
        "lambada",
        "harness:lambada_openai,sst2",
    ]
    assert harness_names("harness:lambada_openai, sst2") == ["lambada_openai", "sst2"]
    with pytest.raises(HLMError, match="names no harness task"):
        harness_names("harness:")


@needs_lambada
def test_harness_lambada_openai_agrees_with_hlm_lambada(tiny_decoder_dir, tmp_path):
    """`hlm eval --task lambada,harness:lambada_openai` on one model: same passages, same
    perplexity and accuracy, both at the trained context (64 < the model's 128 positions, so
    most passages are left-truncated: a harness left at 128 positions would disagree), and
    both logged to the run's MLflow run."""
    import mlflow

    from hlm_ray.tracking import MlflowTracker, write_run_ref

    run_dir = Path(tiny_decoder_dir).parent
    tracker = MlflowTracker("hlm-test-harness", run_name="harness")
    write_run_ref(run_dir, tracker.run_id, tracker.tracking_uri)
    tracker.finish("FINISHED")
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(run_dir), "--task", "lambada,harness:lambada_openai"]
    assert main([*argv, "--limit", "30", "--batch-size", "8", "--output", str(out)]) == 0

    ours = json.loads((out / "eval_lambada.json").read_text())["metrics"]
    result = json.loads((out / "eval_harness-lambada_openai.json").read_text())
    theirs = result["metrics"]
    assert result["offline"] == ["lambada_openai"]
    assert ours["eval/context_length"] == theirs["eval/context_length"] == 64
    assert ours["lambada/num_examples"] == theirs["harness/lambada_openai/num_examples"] == 30
    assert theirs["harness/lambada_openai/perplexity"] == pytest.approx(
        ours["lambada/perplexity"], rel=1e-3
    )
    assert theirs["harness/lambada_openai/acc"] == ours["lambada/accuracy"]

    logged = mlflow.MlflowClient().get_run(tracker.run_id).data.metrics
    assert logged["eval/harness/lambada_openai/perplexity"] == pytest.approx(
        theirs["harness/lambada_openai/perplexity"]
    )
    assert "eval/lambada/perplexity" in logged


@needs_lambada
def test_the_harness_scores_a_headless_decoder_through_its_readout(tiny_decoder_dir, tmp_path):
    """A headless decoder never fine-tuned (the tiny decoder's run, counts included, marked
    headless): the harness's perplexity is hlm's own LAMBADA perplexity through the same
    readout, for the prior readout (the default) and the tied one, and the two differ."""
    import shutil

    run = tmp_path / "run"
    skip = shutil.ignore_patterns("check*", "mlflow_run.json")  # not the tiny run's MLflow run
    shutil.copytree(Path(tiny_decoder_dir).parent, run, ignore=skip)
    config = json.loads((run / "model" / "config.json").read_text())
    (run / "model" / "config.json").write_text(json.dumps({**config, "hlm_objective": "headless"}))
    perplexities = {}
    for readout in ("prior", "tied"):
        out = tmp_path / readout
        argv = ["eval", "--model", str(run), "--task", "lambada,harness:lambada_openai"]
        argv += ["--limit", "10", "--readout", readout, "--output", str(out)]
        assert main(argv) == 0
        ours = json.loads((out / "eval_lambada.json").read_text())
        theirs = json.loads((out / "eval_harness-lambada_openai.json").read_text())
        assert ours["readout"]["name"] == theirs["readout"]["name"] == readout
        ppl = ours["metrics"]["lambada/perplexity"]
        assert theirs["metrics"]["harness/lambada_openai/perplexity"] == pytest.approx(
            ppl, rel=1e-3
        )
        perplexities[readout] = ppl
    assert perplexities["prior"] != pytest.approx(perplexities["tied"], rel=1e-2)


@pytest.mark.skipif(not has_shared("eval/glue/sst2/dev.tsv"), reason="needs GLUE SST-2 dev")
def test_offline_sst2_reads_every_row_of_the_shipped_dev_file(tmp_path):
    from lm_eval.tasks import get_task_dict

    manager, offline = task_manager(["sst2"], tmp_path)
    assert offline == ["sst2"]
    docs = list(get_task_dict(["sst2"], manager)["sst2"].eval_docs)
    rows = shared_file("eval/glue/sst2/dev.tsv").read_text(encoding="utf-8").splitlines()[1:]
    assert len(docs) == len(rows) == 872
    for doc, row in zip(docs, rows, strict=True):
        sentence, label = row.split("\t")
        assert (doc["sentence"], doc["label"]) == (sentence, int(label))


def test_missing_data_names_the_task_and_the_file(tmp_path, monkeypatch):
    """No data folder and no hub (this machine has none; load_dataset is made to fail at once
    so the test does not wait on timeouts)."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr(datasets, "load_dataset", offline)
    kwargs = {"max_length": 64, "output_dir": tmp_path}
    with pytest.raises(HLMError, match=r"lambada_openai: eval/lambada_openai.jsonl is not in"):
        run_harness(None, None, ["lambada_openai"], **kwargs)
    with pytest.raises(
        HLMError,
        match=r"hellaswag: it has no offline copy .* Rowan/hellaswag could not be loaded \(no network",
    ):
        run_harness(None, None, ["hellaswag"], **kwargs)
    with pytest.raises(HLMError, match="no_such_task: not an lm-evaluation-harness task"):
        run_harness(None, None, ["no_such_task"], **kwargs)
