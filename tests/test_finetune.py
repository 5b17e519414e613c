"""Headless decoder -> generator, the model registry, and the `hlm finetune` / `hlm eval` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hlm_ray.cli import main
from hlm_ray.errors import HLMError
from hlm_ray.finetune.clm import clm_config, model_config_from_hf
from hlm_ray.models import build_model, init_from_pretrained, input_embedding_weight
from hlm_ray.presets import load_config
from hlm_ray.pretrained import load_pretrained, resolve_model_dir
from hlm_ray.tracking import read_run_ref
from hlm_ray.train.loop import train_worker


def _pretrain(folder: Path, preset: str, objective: str, steps: int, **extra) -> Path:
    overrides = {"optim.max_steps": steps, "run.output_dir": str(folder), **extra}
    cfg = load_config(preset, objective=objective, overrides=overrides)
    train_worker(cfg.to_dict(), progress=False)
    return folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # One tokenizer/corpus cache for the module: the per-test cache would retrain the BPE.
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def headless_run(tmp_path_factory, cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLM_CACHE_DIR", str(cache))
        return _pretrain(tmp_path_factory.mktemp("hd") / "run", "tiny-decoder", "headless", 60)


@pytest.fixture(scope="module")
def vanilla_run(tmp_path_factory, cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLM_CACHE_DIR", str(cache))
        return _pretrain(tmp_path_factory.mktemp("vd") / "run", "tiny-decoder", "vanilla", 2)


@pytest.fixture
def shared_cache(cache, monkeypatch):
    monkeypatch.setenv("HLM_CACHE_DIR", str(cache))


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_new_head_starts_as_an_untied_copy_of_the_embedding_and_then_diverges(tmp_path, arch):
    cfg = load_config("tiny-decoder", overrides={"model.arch": arch})
    ids = {"eos_token": 0, "pad_token": 1}
    headless = build_model(cfg.model, vocab_size=96, objective="headless", special_ids=ids)
    assert headless.get_output_embeddings().weight is input_embedding_weight(headless)
    headless.save_pretrained(tmp_path)

    model = build_model(cfg.model, vocab_size=96, objective="vanilla", special_ids=ids)
    init_from_pretrained(model, str(tmp_path), new_head=True)
    head, embedding = model.get_output_embeddings().weight, input_embedding_weight(model)
    torch.testing.assert_close(head, embedding, rtol=0, atol=0)
    torch.testing.assert_close(embedding, input_embedding_weight(headless), rtol=0, atol=0)
    assert head.data_ptr() != embedding.data_ptr()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    input_ids = torch.randint(2, 96, (2, 16))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    assert (head - embedding).abs().max() > 1e-4

    model.save_pretrained(tmp_path / "ft")  # the untied head survives save / load
    again = type(model).from_pretrained(tmp_path / "ft")
    torch.testing.assert_close(again.get_output_embeddings().weight, head)
    assert again.config.hlm_finetuned == "clm" and again.config.hlm_objective == "headless"
    assert model_config_from_hf(tmp_path).arch == arch


def test_probe_trains_only_the_head(tmp_path):
    cfg = load_config("tiny-decoder")
    ids = {"eos_token": 0, "pad_token": 1}
    build_model(cfg.model, vocab_size=64, objective="headless", special_ids=ids).save_pretrained(
        tmp_path
    )
    model = build_model(cfg.model, vocab_size=64, objective="vanilla", special_ids=ids)
    init_from_pretrained(model, str(tmp_path), new_head=True, train="head")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 1 and trainable[0] is model.get_output_embeddings().weight


def test_finetune_lowers_lambada_perplexity(headless_run, tmp_path, shared_cache):
    from hlm_ray.evaluate.lambada import load_lambada, score_lambada

    examples = load_lambada(limit=100)
    before = load_pretrained(headless_run)
    assert before.objective == "headless" and before.finetuned is None
    ppl_before = score_lambada(before.model, before.tokenizer, examples, progress=False)

    cfg, facts = clm_config(headless_run, recipe="tiny", output_dir=tmp_path / "gen")
    assert cfg.objective.name == "vanilla" and cfg.init.new_head
    assert 0 < facts["pretrain_token_fraction"] < 1
    train_worker(cfg.to_dict(), progress=False)
    after = load_pretrained(tmp_path / "gen")
    assert after.finetuned == "clm" and after.objective == "headless"
    ppl_after = score_lambada(after.model, after.tokenizer, examples, progress=False)
    assert ppl_after["lambada/perplexity"] < 0.5 * ppl_before["lambada/perplexity"]


def test_bad_finetune_requests_say_what_to_do(vanilla_run, headless_run, tmp_path, capsys):
    with pytest.raises(HLMError, match="nothing to fine-tune"):
        clm_config(vanilla_run, output_dir=tmp_path / "x")
    with pytest.raises(HLMError, match="unknown clm recipe"):
        clm_config(headless_run, recipe="fast", output_dir=tmp_path / "x")
    with pytest.raises(HLMError, match="is not a model"):
        resolve_model_dir(tmp_path)
    with pytest.raises(HLMError, match="does not exist"):
        resolve_model_dir(tmp_path / "nope")
    assert main(["finetune", "--task", "clm", "--model", str(headless_run), "--alias", "a"]) == 2
    assert "give --register NAME too" in capsys.readouterr().err
    assert main(["finetune", "--task", "glue:sst2", "--model", str(vanilla_run)]) == 2
    assert "needs an encoder" in capsys.readouterr().err
    assert main(["finetune", "--task", "squad", "--model", str(vanilla_run)]) == 2
    assert "glue:sst2" in capsys.readouterr().err
    assert main(["eval", "--task", "nope", "--model", str(vanilla_run)]) == 2
    assert "lambada" in capsys.readouterr().err


def test_register_and_load_from_the_registry(vanilla_run):
    import mlflow

    from hlm_ray.model_card import write_model_card
    from hlm_ray.tracking import download_model, register_model

    write_model_card(vanilla_run / "model")
    name, version = register_model(
        vanilla_run / "model",
        "test-registry",
        extra_files=[vanilla_run / "config.yaml"],
        results={"lambada/accuracy": 0.5},
        alias="champion",
    )
    assert name == "test-registry" and version >= 1
    uri = f"models:/{name}/{version}"
    # hlm's loaders, by version and by alias: the flavor's model/ folder with every hlm file.
    for ref in (uri, f"models:/{name}@champion"):
        pre = load_pretrained(ref)
        assert pre.family == "decoder" and pre.run_config is not None
    folder = download_model(uri)
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "eval_results.json"} <= files
    assert {"token_bytes.npy", "config.yaml", "README.md"} <= files
    # MLflow's own API: a transformers-flavor text-generation model with a signature.
    model = mlflow.pyfunc.load_model(uri)
    assert model.metadata.signature.inputs.input_types() == [mlflow.types.DataType.string]
    assert model.metadata.flavors["transformers"]["task"] == "text-generation"
    (text,) = model.predict(["The king said"], params={"max_new_tokens": 4})
    assert text.startswith("The king said") and len(text) > len("The king said")
    pipe = mlflow.transformers.load_model(f"models:/{name}@champion")
    assert type(pipe).__name__ == "TextGenerationPipeline"
    client = mlflow.MlflowClient()
    assert client.get_model_version(name, str(version)).tags["result.lambada/accuracy"] == "0.5"
    with pytest.raises(HLMError, match="cannot be loaded from the registry"):
        load_pretrained("models:/no-such-model/1")
    with pytest.raises(HLMError, match="not a registry URI"):
        load_pretrained("models:/only-a-name")
    with pytest.raises(HLMError, match="text-generation, text-classification"):
        register_model(vanilla_run / "model", "test-registry", task="fill-mask")


def test_cli_finetune_clm_then_eval_from_the_registry(headless_run, tmp_path, capsys):
    import mlflow

    out = tmp_path / "gen"
    argv = ["finetune", "--task", "clm", "--model", str(headless_run), "--local"]
    argv += ["--output", str(out), "--register", "cli-gen", "--alias", "candidate"]
    assert main([*argv, "--eval-limit", "50"]) == 0
    printed = capsys.readouterr().out
    assert "registered cli-gen version" in printed and "lambada" in printed
    assert "models:/cli-gen@candidate" in printed
    card = (out / "model" / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "lambada/accuracy" in card
    assert "fine-tuned from" in card and "must be fine-tuned" not in card
    facts = json.loads((out / "finetune.json").read_text())
    assert facts["recipe"] == "tiny" and facts["finetune_tokens"] > 0

    run_id = read_run_ref(out)["run_id"]
    run = mlflow.MlflowClient().get_run(run_id)
    assert "eval/lambada/accuracy" in run.data.metrics
    assert run.data.params["finetune.recipe"] == "tiny"
    (version,) = mlflow.MlflowClient().search_model_versions("name='cli-gen'")
    assert version.run_id == run_id

    model_id = version.source.removeprefix("models:/")  # the logged model the version is
    logged = mlflow.MlflowClient().get_logged_model(model_id)
    assert {"eval/lambada/accuracy", "metrics.lambada/accuracy"} <= {m.key for m in logged.metrics}
    assert load_pretrained("models:/cli-gen@candidate").finetuned == "clm"
    uri = f"models:/cli-gen/{version.version}"
    argv = ["eval", "--model", uri, "--task", "lambada", "--limit", "20"]
    assert main([*argv, "--output", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "eval_lambada.json").is_file()
    assert "lambada" in capsys.readouterr().out


def test_raw_headless_decoder_card_says_how_it_generates(headless_run, vanilla_run, tmp_path):
    """With its token counts: bold, right under the title, that it generates through its prior
    readout (and what plain transformers needs); without them: that it must be fine-tuned."""
    import shutil

    from hlm_ray.model_card import model_card_text
    from hlm_ray.readout import READOUT_FILE
    from hlm_ray.unigram import COUNTS_FILE

    card = model_card_text(headless_run / "model")
    front, _, body = card.partition("\n---\n")
    assert "pipeline_tag: feature-extraction" in front and "- headless" in front
    top = body.strip().splitlines()[2]  # bold, right under the title
    assert top.startswith("**This headless decoder was never fine-tuned: it generates through")
    assert "ReadoutProcessor" in top and "hlm finetune --task clm" in top
    assert "| readout | prior: s·h·Eᵀ/τ + β·log q(w), s = 1, β = 1 (derived;" in card
    assert "| training steps | 60 |" in card and "| corpus |" in card
    bare = tmp_path / "model"
    shutil.copytree(headless_run / "model", bare)
    for name in (COUNTS_FILE, READOUT_FILE):
        (bare / name).unlink()
    top = model_card_text(bare).partition("\n---\n")[2].strip().splitlines()[2]
    assert top.startswith("**This is a raw headless decoder: it cannot generate text yet.**")
    assert "tied input embedding" in top and "hlm finetune --task clm" in top
    vanilla = model_card_text(vanilla_run / "model")
    assert "pipeline_tag: text-generation" in vanilla and "- vanilla" in vanilla
    assert (
        "cannot generate" not in vanilla and "| readout | head (its own output head) |" in vanilla
    )


def test_a_headless_run_scores_and_generates_through_its_prior_readout(
    headless_run, tmp_path, capsys, shared_cache
):
    """What a headless run saves (its exact target counts, a fitted readout.json), then `hlm
    eval` and `hlm generate` with no fine-tune, and `hlm data count` for a run without them."""
    import shutil

    import numpy as np
    from tiny_runs import expected_target_counts

    from hlm_ray.evaluate.readouts import readout_bpb
    from hlm_ray.model_card import write_model_card
    from hlm_ray.pretrained import run_config_of
    from hlm_ray.readout import read_record
    from hlm_ray.train.inputs import build_prepared
    from hlm_ray.unigram import COUNTS_FILE, count_split, load_counts

    model = headless_run / "model"
    cfg = run_config_of(model)
    counts, meta = load_counts(model / COUNTS_FILE)
    assert (meta["source"], meta["steps"], meta["workers"]) == ("training", 60, 1)
    assert (counts == expected_target_counts(cfg, 60)).all()
    record = read_record(model)
    assert record["readout"] == "prior" and record["prior"]["method"] == "derived"
    nats = record["prior"]["fit"]["nats"]  # the fit on validation rows, recorded as a check
    assert nats["fitted"] <= nats["derived"] < nats["tied"]

    scores = {}
    for readout in (None, "tied"):
        out = tmp_path / f"eval-{readout}"
        argv = ["eval", "--model", str(headless_run), "--task", "bpb", "--limit", "20"]
        argv += ["--output", str(out)] + (["--readout", readout] if readout else [])
        assert main(argv) == 0
        result = json.loads((out / "eval_bpb.json").read_text())
        scores[result["readout"]["name"]] = result["metrics"]["bpb/bits_per_byte"]
    assert scores["prior"] < scores["tied"]
    assert "prior readout" in capsys.readouterr().out  # the table's note
    both = readout_bpb(headless_run, limit=20)  # what a sweep trial records
    assert both == pytest.approx({"bpb/tied": scores["tied"], "bpb/prior": scores["prior"]})

    argv = ["generate", "--model", str(headless_run), "The king", "--max-tokens", "4"]
    assert main([*argv, "--seed", "1"]) == 0
    assert "readout=prior" in capsys.readouterr().err

    # A run from before counting existed: `hlm data count` gives it counts of its training
    # split and a fitted readout, and will not replace counts without --force.
    run = tmp_path / "old-run"
    shutil.copytree(headless_run, run)
    for name in (COUNTS_FILE, "readout.json"):
        (run / "model" / name).unlink()
    card = run / "model" / "README.md"
    write_model_card(run / "model")
    assert "it cannot generate text yet" in card.read_text()
    assert main(["data", "count", "--model", str(run)]) == 0
    assert "it generates through its prior readout" in card.read_text()
    assert "readout.json: prior readout" in capsys.readouterr().out
    counted, meta = load_counts(run / "model" / COUNTS_FILE)
    train = count_split(build_prepared(cfg), "train", seq_len=cfg.data.seq_len)
    assert meta["source"] == "corpus" and np.array_equal(counted, train)
    assert read_record(run / "model")["prior"]["fit"]["method"] == "fitted"
    assert main(["data", "count", "--model", str(run)]) == 2
    assert "exists already" in capsys.readouterr().err


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_registered_generator(vanilla_run, tmp_path):
    """`mlflow models serve` (MLflow's own server, not hlm's) on a registered version: about
    15 s to start on a shared 2-core machine."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import time

    import requests

    from hlm_ray.tracking import register_model

    name, version = register_model(vanilla_run / "model", "test-serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = Path(sys.executable).parent  # it starts `uvicorn` from PATH
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    mlflow_cli = shutil.which("mlflow", path=env["PATH"])
    cmd = [mlflow_cli, "models", "serve", "-m", f"models:/{name}/{version}"]
    cmd += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/ping", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        body = {"inputs": ["The king said"], "params": {"max_new_tokens": 4}}
        reply = requests.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        (text,) = reply.json()["predictions"]
        assert text.startswith("The king said")
    finally:
        os.killpg(server.pid, 15)  # the server and its uvicorn worker: the group it leads
        server.wait(timeout=30)
