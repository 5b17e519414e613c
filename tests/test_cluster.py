"""What a run needs on a cluster whose nodes share only the run storage, the tracking server and
the Ray head, as plain functions: the run folder's mirror in the storage, prepared corpora
published there and fetched by workers, the sweep's state there, one tracking server for all
nodes, gloo on the address other nodes reach, inputs found where outputs went. The object store
is a real S3 API on loopback (moto's server, `s3_common`); tests/test_cluster_box.py runs the
same code across namespaced nodes."""

from __future__ import annotations

import json
import shutil
import socket
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from hlm_ray import cluster
from hlm_ray.errors import HLMError
from hlm_ray.prepare import PrepareRequest, TokenBlocks, open_prepared, prepare
from hlm_ray.prepare.store import Store
from hlm_ray.train import network
from hlm_ray.train.run_mirror import PROGRESS, RESULTS, RunMirror

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_run_folder(root: Path) -> Path:
    """A run folder as rank 0 leaves it: metrics, params, the best checkpoint, the model."""
    out = root / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "model.safetensors").write_bytes(b"\0" * 4096)
    (out / "model" / "config.json").write_text("{}")
    (out / "best_checkpoint").mkdir()
    (out / "best_checkpoint" / "hlm_checkpoint.json").write_text('{"step": 10}')
    (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n')
    (out / "params.json").write_text("{}")
    (out / "summary.json").write_text('{"steps": 10}')
    return out


def tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# ------------------------------------------------------------------------ object stores


def test_a_folder_goes_into_an_object_store_and_comes_back(s3, tmp_path):
    """S3 has no folders to rename: a folder is copied in place, and read back whole."""
    local = make_run_folder(tmp_path)
    store = Store.open(f"{s3}/some/where")
    store.upload_dir(local / "model", "model")
    store.upload(local / "summary.json", "summary.json")
    assert store.download("model", tmp_path / "back" / "model")
    assert store.download("summary.json", tmp_path / "back" / "summary.json")
    assert tree(tmp_path / "back" / "model") == tree(local / "model")
    assert (tmp_path / "back" / "summary.json").read_text() == '{"steps": 10}'
    assert not store.download("nothing", tmp_path / "back" / "nothing")
    store.upload_dir(local / "best_checkpoint", "model")  # replaces what was there
    assert store.download("model", tmp_path / "again")
    assert tree(tmp_path / "again") == tree(local / "best_checkpoint")


def test_the_run_mirror_carries_a_run_folder_across_nodes(s3, tmp_path):
    rank0 = make_run_folder(tmp_path / "node-a")
    storage = f"{s3}/runs"
    mirror = RunMirror.of(rank0, storage)
    assert mirror == RunMirror(f"{storage}/run")
    assert RunMirror.of(rank0, str(rank0.parent)) is None  # the storage holds the run folder
    assert RunMirror.of(rank0, None) is None
    mirror.push(rank0, PROGRESS)
    restarted = tmp_path / "node-b" / "run"  # rank 0 restarted on another node
    assert mirror.pull(restarted, RESULTS) == list(PROGRESS)
    assert (restarted / "metrics.jsonl").read_text() == (rank0 / "metrics.jsonl").read_text()
    mirror.push(rank0, RESULTS)
    driver = tmp_path / "head" / "run"
    assert mirror.pull(driver, RESULTS) == [n for n in RESULTS if (rank0 / n).exists()]
    assert tree(driver) == tree(rank0)
    assert not mirror.has_checkpoints()
    Store.open(mirror.uri).upload_dir(rank0 / "best_checkpoint", "checkpoint_00000010")
    assert mirror.has_checkpoints()


def test_rank_0_brings_the_mirror_up_to_a_checkpoint_before_reporting_it(s3, tmp_path, monkeypatch):
    """A worker that dies right after Ray registered the checkpoint must not leave a mirror
    whose history stops before it: the mirror is pushed first, then the report."""
    import ray.train

    from hlm_ray.train.ray_worker import RayReporter

    out = make_run_folder(tmp_path)
    mirror = RunMirror(f"{s3}/runs/run")
    seen = []
    monkeypatch.setattr(
        ray.train, "report", lambda *a, **k: seen.append(Store.open(mirror.uri).exists(PROGRESS[0]))
    )
    monkeypatch.setattr(ray.train.Checkpoint, "from_directory", lambda folder: folder)
    reporter = RayReporter(out, mirror)
    checkpoint = reporter.checkpoint_folder(10)
    checkpoint.mkdir()
    reporter.report({"step": 10}, checkpoint)
    assert seen == [True]


def test_a_checkpoint_the_storage_keeps_waiting_is_said_and_so_is_its_end(
    tmp_path, monkeypatch, capsys
):
    """An object store that stops answering stalls rank 0's checkpoint (the mirror's push, Ray's
    upload inside `report`) with no error: one line says training waits on the storage, one
    that it goes on. A checkpoint stored in time says nothing. Ray's upload is a sleep here."""
    import time

    import ray.train

    from hlm_ray.train import storage_wait
    from hlm_ray.train.ray_worker import RayReporter

    uploads = iter([0.0, 1.5])  # seconds each report's upload takes
    monkeypatch.setattr(ray.train, "report", lambda *a, **k: time.sleep(next(uploads)))
    monkeypatch.setattr(ray.train.Checkpoint, "from_directory", lambda folder: folder)
    monkeypatch.setattr(storage_wait, "STALL_S", 0.5)
    out = make_run_folder(tmp_path)
    reporter = RayReporter(out)  # the run folder's parent is the storage
    for step in (10, 20):
        reporter.checkpoint_folder(step).mkdir()
        reporter.report({"step": step}, reporter.checkpoint_folder(step))
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "checkpoint_00000010 saved",
        f"checkpoint 20: the run storage {tmp_path} has not taken it in 0 s (it does not "
        "answer?); training waits for it and goes on once it is stored",
        f"checkpoint 20: stored in {tmp_path} after 2 s; training goes on",
        "checkpoint_00000020 saved",
    ]


def test_a_run_kept_in_s3_continues_from_its_storage_alone(s3, tmp_path, monkeypatch, capsys):
    """The head that ran `hlm train --storage-path s3://...` failed, and the new one has no run
    folder: `hlm train --resume s3://.../runs/x` (printed `s3:/`, then "no checkpoint_*
    folders", before) and `--resume runs/x --storage-path s3://...` continue the run with its
    own config (its newest whole checkpoint's), launch settings and MLflow run, Ray Train
    given the same storage and name. Ray is not started: the CLI's part is checked here, the
    continued run on the cluster box (`head-restart`)."""
    import hlm_ray.commands.train as train_cmd
    from hlm_ray.presets import load_config

    monkeypatch.setenv("HLM_WORK_DIR", str(tmp_path / "new-head"))
    storage, held = f"{s3}/runs", tmp_path / "lost-head" / "x"
    cfg = load_config("tiny-decoder", overrides={"optim.max_steps": 30, "run.output_dir": "x"})
    for step in (10, 20, 30):  # 30: half uploaded when the head went (no manifest)
        folder = held / f"checkpoint_{step:08d}"
        folder.mkdir(parents=True)
        cfg.save(folder / "config.yaml")
        if step < 30:
            (folder / "hlm_checkpoint.json").write_text(json.dumps({"step": step}))
        Store.open(f"{storage}/x").upload_dir(folder, folder.name)
    launched = {"num_workers": 2, "cpus_per_worker": 2.0, "storage_path": storage}
    (held / "launch.json").write_text(json.dumps(launched))
    (held / "mlflow_run.json").write_text('{"run_id": "abc", "tracking_uri": "http://mlflow"}')
    RunMirror(f"{storage}/x").push(held, ("launch.json", "mlflow_run.json"))
    seen = []

    def run_training(cfg, args, *, resume=None, resume_from=None):
        seen.append((cfg, vars(args).copy(), resume, resume_from))
        raise HLMError("stopped here: Ray Train is not started in this test")

    monkeypatch.setattr(train_cmd, "run_training", run_training)
    for argv in (["--resume", f"{storage}/x"], ["--resume", "runs/x", "--storage-path", storage]):
        assert train_cmd_main(argv) == 2
        cfg_seen, args, resume, resume_from = seen.pop()
        assert cfg_seen.optim.max_steps == 30 and resume.name == "checkpoint_00000020"
        assert resume_from is None  # Ray Train takes the newest from the storage
        assert (args["num_workers"], args["cpus_per_worker"]) == (2, 2.0)
        assert args["storage_path"] == storage and args["output"] == "runs/x"
        run_dir = tmp_path / "new-head" / "runs" / "x"
        assert cfg_seen.run.output_dir == str(run_dir)
        assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == "abc"
        assert f"continuing x from its storage: {storage}/x" in capsys.readouterr().out
        shutil.rmtree(run_dir)  # the next form, from a head without the folder again
    for argv, said in (
        (["--resume", f"{storage}/x/checkpoint_00000010"], "pass the run, "),
        (["--resume", f"{storage}/y"], f"{storage}/y holds no checkpoint of run y"),
    ):
        assert train_cmd_main(argv) == 2
        assert said in capsys.readouterr().err


def train_cmd_main(argv: list[str]) -> int:
    from hlm_ray.cli import main

    return main(["train", *argv])


# ------------------------------------------------------------------------ prepared corpora


@pytest.fixture
def prepared(tmp_path):
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "home"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(300)))
    request = PrepareRequest(sources=(str(corpus),), vocab_size=300, val_fraction=0.1,
                             shard_tokens=2000)  # fmt: skip
    return prepare(request, tmp_path / "prepared" / "bpe300-abc", workers=0, progress=False,
                   allow_smaller_vocab=True)  # fmt: skip


def test_a_prepared_corpus_published_in_storage_reads_as_the_original(s3, prepared, tmp_path):
    uri = cluster.publish_prepared(prepared, f"{s3}/runs/_prepared")
    assert uri == f"{s3}/runs/_prepared/bpe300-abc"
    remote = open_prepared(uri)  # a worker node: read through a local copy
    assert remote.manifest == json.loads(json.dumps(prepared.manifest))
    here = TokenBlocks.open(prepared, "train", seq_len=16)
    there = TokenBlocks.open(remote, "train", seq_len=16)
    assert here.num_blocks == there.num_blocks
    assert (here[np.arange(here.num_blocks)] == there[np.arange(there.num_blocks)]).all()
    # Published again: nothing is copied (the manifest there is the same).
    store = Store.open(uri)
    store.delete("tokenizer")
    assert cluster.publish_prepared(prepared, f"{s3}/runs/_prepared") == uri
    assert not store.exists("tokenizer")


def test_a_fetched_copy_is_reused_and_refreshed_when_the_remote_changes(s3, prepared):
    from hlm_ray.prepare.fetch import local_copy

    uri = cluster.publish_prepared(prepared, f"{s3}/p")
    first = local_copy(uri)
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert local_copy(uri) == first and (first / "manifest.json").stat().st_mtime_ns == stamp
    manifest = {**prepared.manifest, "note": "prepared again"}
    Store.open(uri).write_json("manifest.json", manifest)
    assert json.loads((local_copy(uri) / "manifest.json").read_text())["note"] == "prepared again"
    with pytest.raises(HLMError, match="is not a prepared corpus: no manifest.json"):
        local_copy(f"{s3}/nothing-here")


def test_workers_on_other_nodes_open_the_published_copy(monkeypatch, prepared, s3):
    """On one machine (or with a cache the user shared) the workers open the driver's folder;
    on several nodes, or with run storage in an object store, the copy in the storage."""
    monkeypatch.delenv("HLM_CACHE_DIR")  # the default, private ~/.cache of each node
    assert cluster.publish_root("/runs", 1) is None
    assert cluster.publish_root("/runs", 3) == "/runs/_prepared"
    assert cluster.publish_root(f"{s3}/runs", 1) == f"{s3}/runs/_prepared"
    assert cluster.prepared_location(prepared, "/nowhere", 1) == prepared.uri
    assert cluster.prepared_location(prepared, f"{s3}/r", 1) == f"{s3}/r/_prepared/bpe300-abc"
    monkeypatch.setenv("HLM_CACHE_DIR", "/mnt/shared/cache")  # the user's shared cache
    assert cluster.publish_root(f"{s3}/runs", 3) is None


def test_a_trial_opens_its_corpus_s_published_copy():
    from hlm_ray.presets import load_config

    cfg = load_config("tiny-decoder")
    located = {cluster.request_key(cfg): "s3://b/runs/_prepared/x"}
    assert cluster.pin_prepared(cfg, located).data.prepared == "s3://b/runs/_prepared/x"
    assert cluster.pin_prepared(cfg, {}).data.prepared == cfg.data.prepared
    other = load_config("tiny-decoder", overrides=["tokenizer.vocab_size=2048"])
    assert cluster.pin_prepared(other, located).data.prepared == other.data.prepared


def test_a_prepared_folder_missing_on_this_node_says_what_to_share(tmp_path):
    with pytest.raises(HLMError, match="does not exist on this node .*HLM_CACHE_DIR"):
        open_prepared(tmp_path / "driver-cache" / "bpe1024-0123")


def test_a_fine_tunes_source_model_reaches_workers_on_other_nodes(s3, tmp_path, monkeypatch):
    """`hlm finetune --model runs/x` on a cluster: the driver finds the model on its own node's
    disk, and a worker on another node starts from its copy in the run storage. (The box's
    registry scenario failed whenever the fine-tune's worker sat on another node than the
    pretraining's rank 0: FileNotFoundError for the driver's path.)"""
    from hlm_ray.presets import load_config

    model = make_run_folder(tmp_path / "driver") / "model"
    here = str(model)
    assert cluster.model_location(here, f"{s3}/runs", 1) == here  # one machine: its own disk
    uri = cluster.model_location(here, f"{s3}/runs", 2)
    assert uri.startswith(f"{s3}/runs/_inputs/run-model-"), uri
    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "worker-node-cache"))
    copy = Path(cluster.local_model_dir(uri))
    assert copy.is_dir() and tree(copy) == {**tree(model), "hlm-published.json": ANY_BYTES}
    assert cluster.model_location(here, f"{s3}/runs", 2) == uri  # published once
    (model / "config.json").write_text('{"trained": "again"}')
    again = cluster.model_location(here, f"{s3}/runs", 2)
    assert again != uri and (Path(cluster.local_model_dir(again)) / "config.json").read_text() == (
        '{"trained": "again"}'
    )
    # A shared volume: a model already in the run storage is read where it is; one elsewhere
    # is copied in, and read there by path.
    volume = tmp_path / "volume"
    inside = make_run_folder(volume / "runs") / "model"
    assert cluster.model_location(str(inside), str(volume), 2) == str(inside)
    copied = cluster.model_location(here, str(volume), 2)
    assert Path(copied).parent == volume / "_inputs" and tree(Path(copied))["config.json"]
    assert cluster.local_model_dir(copied) == copied
    with pytest.raises(HLMError, match="not a published model folder: no hlm-published.json"):
        cluster.local_model_dir(f"{s3}/runs/_inputs/nothing")
    # What launch() hands the workers.
    given = [f"init.model_dir={here}", "init.new_head=true", f"data.prepared={s3}/p"]
    cfg = load_config("tiny-decoder", overrides=given)
    paths = cluster.worker_paths(cfg, f"{s3}/runs", 2, prepared=lambda: None)
    assert paths["init.model_dir"] == again
    assert (
        cluster.worker_paths(cfg, f"{s3}/runs", 1, prepared=lambda: None)["init.model_dir"] == here
    )


class _AnyBytes(bytes):
    def __eq__(self, other):
        return isinstance(other, bytes)

    __hash__ = bytes.__hash__


ANY_BYTES = _AnyBytes()


# ------------------------------------------------------------------------ tracking, sweeps


def test_several_machines_need_a_tracking_server_they_all_reach():
    cluster.check_tracking("sqlite:////home/me/mlflow.db", 1)
    cluster.check_tracking("http://mlflow:5000", 3)
    with pytest.raises(HLMError, match="3 machines but MLflow's store is sqlite.*MLFLOW_TRACKING"):
        cluster.check_tracking("sqlite:////home/me/mlflow.db", 3)


def test_nodes_of_one_address_are_one_machine():
    """Several raylets on one host (tests/test_multinode.py) share its disk and loopback: the
    embedded store and the driver's cache serve them all."""
    node = {"Alive": True, "NodeManagerAddress": "192.0.2.2"}
    assert cluster.machines([node, dict(node)]) == 1
    assert cluster.machines([node, {**node, "NodeManagerAddress": "198.18.0.11"}]) == 2
    assert cluster.machines([]) == 1


def test_a_sweep_keeps_its_state_and_trials_in_the_storage(s3, tmp_path):
    from hlm_ray.tune.storage import STATE_FILE, SweepStorage

    folder = tmp_path / "runs" / "sweeps" / "vocab-x"
    assert SweepStorage.of(folder, None, "vocab-x") == SweepStorage(folder)
    assert SweepStorage.of(folder, str(folder.parent), "vocab-x").remote is None
    store = SweepStorage.of(folder, f"{s3}/sweeps", "vocab-x")
    assert store.tune_path == f"{s3}/sweeps/vocab-x"
    assert store.trials == f"{s3}/sweeps/vocab-x/trials"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"storage": store.remote}))
    store.push_state()
    new_head = SweepStorage.of(tmp_path / "elsewhere" / "vocab-x", f"{s3}/sweeps", "vocab-x")
    new_head.folder.mkdir(parents=True)
    new_head.pull_state()  # a head without the folder resumes from the storage's copy
    state = json.loads((new_head.folder / STATE_FILE).read_text())
    new_head.check_same(state)
    with pytest.raises(HLMError, match="resume it with the --storage-path it started with"):
        SweepStorage(folder).check_same(state)
    trial = make_run_folder(tmp_path / "node-a")
    (trial / "downstream.json").write_text('{"downstream/score": 0.5}')
    RunMirror(f"{store.trials}/headless-v8-s0-t1").push(trial, ("summary.json", "downstream.json"))
    store.pull_trials(["headless-v8-s0-t1"])
    got = folder / "trials" / "headless-v8-s0-t1"
    assert json.loads((got / "downstream.json").read_text()) == {"downstream/score": 0.5}
    assert not store.tuner_exists()


# ------------------------------------------------------------------------ gloo, paths

Address = namedtuple("Address", "family address")


def test_gloo_listens_on_the_interface_of_the_node_address(monkeypatch):
    interfaces = {
        "lo": [Address(socket.AF_INET, "127.0.0.1")],
        "eth0": [Address(socket.AF_INET6, "fe80::1"), Address(socket.AF_INET, "198.18.0.11")],
    }
    assert network.interface_of("198.18.0.11", interfaces) == "eth0"
    assert network.interface_of("10.0.0.9", interfaces) is None
    import psutil
    import ray.util

    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "198.18.0.11")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert network.bind_gloo_to_node_address() == "eth0"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the user's choice stays
    assert network.bind_gloo_to_node_address() == "ib0"


def test_the_trainer_sets_gloo_up_on_every_worker_before_the_process_group():
    from ray.train.torch.config import _TorchBackend

    calls = []

    class Group:
        def execute(self, fn, *a, **k):
            calls.append(fn)

    config = network.torch_config()
    backend = config.backend_cls()
    assert isinstance(backend, _TorchBackend)
    original = _TorchBackend.on_start
    try:
        _TorchBackend.on_start = lambda self, group, cfg: calls.append("process group")
        backend.on_start(Group(), config)
    finally:
        _TorchBackend.on_start = original
    assert calls == [network.bind_gloo_to_node_address, "process group"]


def test_an_input_is_found_where_outputs_went(tmp_path, monkeypatch):
    """In `ray job submit --working-dir .` the job runs in Ray's copy while `--output runs/x`
    lands in the checkout: `--model runs/x` afterwards must find it there."""
    from hlm_ray.paths import resolve_input

    work = tmp_path / "checkout"
    (work / "runs" / "x").mkdir(parents=True)
    copy = tmp_path / "copy"
    copy.mkdir()
    monkeypatch.setenv("HLM_WORK_DIR", str(work))
    monkeypatch.chdir(copy)
    assert resolve_input("runs/x") == work / "runs" / "x"
    (copy / "runs" / "x").mkdir(parents=True)
    assert resolve_input("runs/x") == Path("runs/x")  # the current folder first
    assert resolve_input("runs/none") == Path("runs/none")  # neither: as given, for its error


def test_artifacts_come_through_the_tracking_server_unless_the_user_says(monkeypatch):
    """A server over S3 offers presigned URLs of its own endpoint, which a client outside the
    cluster's network retries for minutes: hlm's clients keep to the proxy by default."""
    from hlm_ray.tracking.store import bound_http_waits

    monkeypatch.delenv("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD", "true")  # the user's choice
    bound_http_waits()
    import os

    assert os.environ["MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD"] == "false"
    assert os.environ["MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD"] == "true"


def test_a_prepared_uri_reaches_the_workers_as_given():
    from hlm_ray.cluster import absolute

    assert absolute("s3://bucket/runs/_prepared/x") == "s3://bucket/runs/_prepared/x"
    assert absolute("runs/p") == str(Path("runs/p").resolve())
