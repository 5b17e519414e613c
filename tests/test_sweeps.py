"""The ablation sweeps: grid and resource checks as plain functions, then each tiny sweep end to
end on the shared Ray cluster (Train inside Tune, MLflow parent and child runs, resume)."""

import ast
import contextlib
import csv
import json
import math
from types import SimpleNamespace

import pytest
from sweep_common import (
    EXPERIMENT,
    FAST,
    ROOT,
    check_trials_carry_their_values,
    load_script,
    set_args,
    summary_rows,
    sweep_main,
    sweep_runs,
    use_mlflow_server,
)

from hlm_ray.errors import HLMError
from hlm_ray.flops import config_step_flops
from hlm_ray.paths import data_dir
from hlm_ray.tracking import JsonlTracker, read_run_ref
from hlm_ray.tune import spec as spec_mod
from hlm_ray.tune.placement import plan_concurrency
from hlm_ray.tune.spec import SweepSpec
from hlm_ray.tune.summary import markdown_table, write_summary
from hlm_ray.tune.sweep import _close_orphans, _rows, check_resume, prepare_inputs
from hlm_ray.tune.trial import TrialRuntime, final_metrics, local_trials, trial_resources

SHAKESPEARE = data_dir() / "corpus" / "en" / "tinyshakespeare.txt"
_set, _load_script, _sweep_main = set_args, load_script, sweep_main
_runs, _summary = sweep_runs, summary_rows


SCRIPTS = {p.stem: _load_script(p) for p in sorted((ROOT / "sweeps").glob("*.py"))}
VOCAB = SCRIPTS["vocab"]


def get_sweep(kind: str, preset: str, overrides=None) -> SweepSpec:
    """The preset of sweeps/<kind>.py with `--set` overrides, as the script builds it."""
    return spec_mod.get_sweep(SCRIPTS[kind].PRESETS, preset, overrides)


# ------------------------------------------------------------------------------ plain checks


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.py")), ids=lambda p: p.name)
def test_every_sweep_script_imports(path):
    script = _load_script(path)
    assert callable(script.main)
    assert {"tiny", "paper"} <= set(script.PRESETS)
    assert all(spec.axis is script.AXIS for spec in script.PRESETS.values())
    assert script.AXIS.name == path.stem


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_every_preset_builds_valid_trial_configs(kind):
    for preset in SCRIPTS[kind].PRESETS:
        spec = get_sweep(kind, preset)
        for cell in spec.cells():
            cfg = spec.cell_config(cell["value"], cell["objective"], cell["seed"])
            cfg.optim.grad_accum_steps(spec.workers_per_trial)  # raises if inconsistent
            spec.base_config()


# One sweep's own code in hlm_ray/tune (its tables set config keys such as a vocabulary size).
ONE_SWEEPS_CODE = (
    "families.py",
    "headline.py",
    "vocab_report.py",
    "scaling.py",
    "scaling_report.py",
    "generator_grid.py",
)


def test_the_tune_package_names_no_axis():
    """Every ablation is described by its script's Axis; the machinery of hlm_ray/tune (all but
    the modules of one sweep's families and report) knows none by name."""
    names = {script.AXIS.name for script in SCRIPTS.values()}
    fields = {script.AXIS.field for script in SCRIPTS.values()}
    tune = ROOT / "hlm_ray" / "tune"
    assert all((tune / name).is_file() for name in ONE_SWEEPS_CODE)
    for path in (p for p in tune.glob("*.py") if p.name not in ONE_SWEEPS_CODE):
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        strings = {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
        }
        assert not strings & (names | fields), path.name


def test_an_empty_grid_fails_before_anything_runs():
    with pytest.raises(HLMError, match="sweep.values is empty"):
        get_sweep("vocab", "tiny", ["sweep.values=[]"])
    with pytest.raises(HLMError, match="sweep.objectives is empty"):
        get_sweep("batch_size", "tiny", ["sweep.objectives=[]"])
    with pytest.raises(HLMError, match="unknown config field sweep.valuez"):
        get_sweep("vocab", "tiny", ["sweep.valuez=[512]"])
    with pytest.raises(HLMError, match="unknown config field optim.lrr"):
        get_sweep("vocab", "tiny", ["optim.lrr=1"])


def test_the_headline_sweep_needs_its_downstream_scores():
    from hlm_ray.tune.families import check_families as check

    check(get_sweep("headline", "tiny"))
    with pytest.raises(HLMError, match="sweep.recipe=none: the headline report needs"):
        check(get_sweep("headline", "tiny", ["sweep.recipe=none"]))


def test_a_vocabulary_below_the_special_tokens_fails_before_training():
    # Encoders: 256 bytes + eos, pad, mask, cls, sep.
    spec = get_sweep("vocab", "tiny", ["sweep.values=[260,512]"])
    with pytest.raises(HLMError, match="260 is below .* use sizes >= 261"):
        VOCAB.check_vocab_sizes(spec)
    VOCAB.check_vocab_sizes(get_sweep("vocab", "tiny", ["sweep.values=[261]"]))


def test_a_vocabulary_larger_than_the_corpus_supports_is_said_and_recorded(tmp_path, capsys):
    corpus = tmp_path / "small.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:20_000])
    items = [f"data.sources=[{corpus}]", "sweep.values=[300,20000]"]
    with pytest.raises(HLMError, match="20000 is more than the corpus supports: .*stopped at"):
        prepare_inputs(get_sweep("vocab", "tiny", items), progress=False)
    spec = get_sweep("vocab", "tiny", [*items, "sweep.allow_smaller_vocab=true"])
    real, located = prepare_inputs(spec, progress=False)
    assert located == {}  # one machine: the trials open the cache's folders
    assert real[300] == 300 and 300 < real[20000] < 20000
    assert f"BPE training stopped at {real[20000]} tokens" in capsys.readouterr().out


def test_concurrency_comes_from_the_cluster_and_impossible_trials_fail():
    spec = get_sweep("vocab", "tiny")
    assert plan_concurrency(spec, 4, [{"CPU": 2.0}]) == 2
    assert plan_concurrency(spec, 4, [{"CPU": 16.0}]) == 4  # never more than the trials
    two = get_sweep("vocab", "tiny", ["sweep.workers_per_trial=2", "sweep.cpus_per_worker=2"])
    assert plan_concurrency(two, 8, [{"CPU": 8.0}, {"CPU": 4.0}]) == 3
    gpu = get_sweep("vocab", "tiny", ["sweep.workers_per_trial=2", "sweep.gpus_per_worker=1"])
    assert plan_concurrency(gpu, 8, [{"CPU": 32.0, "GPU": 4.0}, {"CPU": 32.0, "GPU": 2.0}]) == 3
    # Workers are placed whole on a node: three 3-CPU nodes hold three 2-CPU workers, not four.
    two_cpu = get_sweep("vocab", "tiny", ["sweep.cpus_per_worker=2"])
    assert plan_concurrency(two_cpu, 8, [{"CPU": 3.0}] * 3) == 3
    with pytest.raises(HLMError, match="needs 2 worker.* of 2 CPU but the cluster's nodes hold 1"):
        plan_concurrency(two, 4, [{"CPU": 3.0}, {"CPU": 1.0}])
    with pytest.raises(HLMError, match="needs 2 worker.* = 4 CPUs but the cluster has 2"):
        plan_concurrency(two, 4, [{"CPU": 2.0}, {"CPU": 2.0}][:1])
    with pytest.raises(HLMError, match="a worker needs 3 CPUs but the largest node has 2"):
        plan_concurrency(
            get_sweep("vocab", "tiny", ["sweep.cpus_per_worker=3"]), 4, [{"CPU": 2.0}] * 2
        )
    with pytest.raises(HLMError, match="GPU"):
        plan_concurrency(gpu, 4, [{"CPU": 2.0}])


def test_one_worker_cpu_trials_on_one_node_train_in_the_trials_own_process():
    """Ray Train's local mode where it saves a worker group's start and loses nothing: one CPU
    worker, one node, no ASHA (its reports need a worker group), `sweep.local_trials` on. The
    trial then reserves the worker's CPUs itself."""
    one_node = [{"CPU": 4.0, "GPU": 1.0}]
    assert local_trials(get_sweep("vocab", "tiny"), one_node, search=False)
    assert not local_trials(get_sweep("vocab", "tiny"), one_node, search=True)
    assert not local_trials(get_sweep("vocab", "tiny"), one_node * 2, search=False)
    # a --storage-path other than the run folders: local mode hands Ray no checkpoint to copy
    assert not local_trials(get_sweep("vocab", "tiny"), one_node, False, "s3://b/sweep/trials")
    for item in ("workers_per_trial=2", "gpus_per_worker=1", "local_trials=false"):
        assert not local_trials(get_sweep("vocab", "tiny", [f"sweep.{item}"]), one_node, False)
    common = dict(sweep="s", kind="vocab", experiment="e", parent_run_id=None, trials_dir="t",
                  recipe="tiny", workers=1, cpus_per_worker=1.5, gpus_per_worker=0.0)  # fmt: skip
    assert trial_resources(TrialRuntime(**common, local=True))["cpu"] == 1.5
    assert trial_resources(TrialRuntime(**common, local=False))["cpu"] == 0


def test_the_tune_space_resolves_to_the_grid_cells():
    from ray.tune.search.variant_generator import generate_variants

    from hlm_ray.config import Config

    for kind, items in (
        ("vocab", ["sweep.num_seeds=2"]),
        ("batch_size", ["sweep.workers_per_trial=2"]),
    ):
        spec = get_sweep(kind, "tiny", items)
        variants = [cfg for _, cfg in generate_variants(spec.param_space())]
        resolved = [cfg["config"] for cfg in variants]
        assert len(resolved) == len(spec.cells())
        for cell in spec.cells():
            expected = spec.cell_config(cell["value"], cell["objective"], cell["seed"])
            assert sum(Config.from_dict(r) == expected for r in resolved) == 1, cell
            matching = [v["value"] for v in variants if Config.from_dict(v["config"]) == expected]
            assert matching == [cell["value"]]
    spec = get_sweep("batch_size", "tiny", ["sweep.workers_per_trial=2"])
    assert spec.cell_config(8, "headless", 0).optim.global_batch_size == 16  # micro × workers


def test_search_samples_lr_and_warmup_for_one_cell():
    from ray.tune.search.variant_generator import generate_variants

    items = ["sweep.search_lr=[1e-4,1e-2]", "sweep.search_warmup=[0,5]", "sweep.values=[512,1024]"]
    spec = get_sweep("vocab", "tiny", items)
    (_, cfg), *_ = generate_variants(spec.param_space(search=True))
    optim = cfg["config"]["optim"]
    assert 1e-4 <= optim["lr"] <= 1e-2 and optim["warmup_steps"] in (0, 5)
    assert cfg["config"]["objective"]["name"] == "headless"
    assert cfg["config"]["tokenizer"]["vocab_size"] == 512
    assert cfg["config"]["run"]["eval_every"] == cfg["config"]["run"]["checkpoint_every"]


def test_resuming_with_other_settings_is_refused(tmp_path):
    spec = get_sweep("vocab", "tiny")
    assert check_resume(tmp_path, spec, search=False) is None
    state = {"spec": spec.identity(), "search": False, "parent_run_id": "abc"}
    (tmp_path / "sweep.json").write_text(json.dumps(state))
    assert check_resume(tmp_path, spec, search=False)["parent_run_id"] == "abc"
    # Resources may change on resume; the grid may not.
    assert check_resume(tmp_path, get_sweep("vocab", "tiny", ["sweep.cpus_per_worker=2"]), False)
    with pytest.raises(HLMError, match=r"other settings \(values\)"):
        check_resume(tmp_path, get_sweep("vocab", "tiny", ["sweep.values=[512]"]), False)


def test_final_metrics_carry_k_v_head_share_and_bits_per_byte():
    spec = get_sweep("vocab", "tiny")
    cfg = spec.cell_config(512, "vanilla", 0)
    summary = {
        "vocab_size": 512,
        "tokens_per_s": 1000.0,
        "metrics": {
            "train/K": 150.0,
            "val/loss": 5.0,
            "val/token_bpb": 2.5,
            "train/peak_mem_mb": 9.0,
        },
    }
    out = final_metrics(cfg, summary, {"downstream/score": 0.6}, workers=1)
    assert out["K_over_V"] == pytest.approx(150 / 512)
    assert out["head_flop_share"] == pytest.approx(config_step_flops(cfg, 512).head_share)
    assert (out["token_bpb"], out["loss"], out["downstream/score"]) == (2.5, 5.0, 0.6)
    assert math.isnan(out["text_bpb"])  # no held-out text was scored
    # A decoder's downstream bits per byte (of the fine-tuned generator, over text bytes) is
    # its own column beside pretraining's (over the target tokens' bytes).
    out = final_metrics(cfg, summary, {"bpb/bits_per_byte": 1.5}, workers=1)
    assert out["text_bpb"] == 1.5 and out["token_bpb"] == 2.5
    assert math.isnan(out["downstream/score"])


def test_trial_times_of_a_trial_trained_in_an_earlier_attempt_are_not_negative():
    """A resumed sweep's trial whose training had finished before the kill: its summary holds
    the earlier attempt's 40 s of steps, this attempt ran 5 s of downstream. The summary
    showed `trial s 0`, `overhead s -4`; now this attempt's overhead is its wall time."""
    from hlm_ray.tune.trial import trial_times

    summary = {"seconds": {"train": 40.0, "setup": 2.0, "checkpoint": 1.0, "worker": 45.0}}
    now = trial_times(summary, 100.0, 101.0, 105.0, trained_now=True)
    assert now["trial/train_s"] == 40.0 and now["trial/overhead_s"] == -35.0  # the old sum
    again = trial_times(summary, 100.0, 101.0, 105.0, trained_now=False)
    assert again["trial/train_s"] == 0.0
    assert again["trial/overhead_s"] == again["trial/wall_s"] == 5.0
    assert "trial/worker_setup_s" not in again
    fresh = trial_times(summary, 0.0, 50.0, 55.0)
    assert fresh["trial/overhead_s"] == 15.0 and fresh["trial/trainer_s"] == 5.0


def test_a_fit_without_ray_datasets_starts_no_dataset_manager():
    """hlm's workers read their own data: Ray's DatasetsCallback (a DatasetManager actor per
    fit) is left out unless the trainer is given Ray datasets."""
    import ray.train
    from ray.train.v2._internal.callbacks import DatasetsCallback

    from hlm_ray.train.interrupt import trainer_class

    def kinds(**kw):
        trainer = trainer_class()(lambda: None, scaling_config=ray.train.ScalingConfig(), **kw)
        return {type(cb) for cb in trainer._create_default_callbacks()}

    assert DatasetsCallback not in kinds()
    # A dataset factory (no Ray Data dataset here: building one would start Ray).
    assert DatasetsCallback in kinds(datasets={"train": lambda: None})


def test_the_summary_keeps_failed_trials(tmp_path):
    spec = get_sweep("vocab", "tiny")
    runtime = TrialRuntime("s", "vocab", EXPERIMENT, None, str(tmp_path), "tiny", 1, 1.0, 0.0)

    def result(value, objective, metrics, error=None):
        config = {"config": spec.cell_config(value, objective, 0).to_dict(), "value": value}
        return SimpleNamespace(metrics=metrics, config=config, error=error, path=str(tmp_path))

    ok = {"trial_id": "t1", "downstream/score": 0.7, "tokens_per_s": 900.0, "K": 10.0, "V": 512.0}
    results = [
        result(512, "headless", ok),
        result(1024, "vanilla", {"trial_id": "t2"}, RuntimeError("boom\nHLMError: out of memory")),
    ]
    rows = _rows(results, spec, runtime, search=False)
    assert [(r["trial_id"], r["status"]) for r in rows] == [("t1", "FINISHED"), ("t2", "FAILED")]
    assert rows[1]["error"] == "HLMError: out of memory"
    assert rows[0]["run"] == "headless-v512-s0-t1"
    files = write_summary(rows, tmp_path, axis=VOCAB.AXIS)
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["vocab_size"], r["status"]) for r in table] == [
        ("512", "FINISHED"),
        ("1024", "FAILED"),
    ]
    assert "| FAILED |" in markdown_table(rows, VOCAB.AXIS)
    assert {p.name for p in files} >= {
        "fig7a_score_vs_vocab.png",
        "fig7b_tokens_per_s_vs_vocab.png",
    }
    assert all(p.stat().st_size > 0 for p in files)


def test_a_diverged_trial_fails_the_sweep_and_the_advice_fits(tmp_path):
    """A sweep whose every trial diverged ended with its parent run FINISHED, and said to re-run
    the same command, which diverges again. A diverged trial ends without Tune's retries and
    reports why; the parent is FAILED and says what happened; the advice depends on the error."""
    from hlm_ray.tune.cli import failure_advice
    from hlm_ray.tune.summary import sweep_status

    spec = get_sweep("vocab", "tiny")
    runtime = TrialRuntime("s", "vocab", EXPERIMENT, None, str(tmp_path), "tiny", 1, 1.0, 0.0)
    nan = "training diverged: the loss is nan at step 2 (first non-finite in steps 2..2); ..."

    def result(value, metrics, error=None):
        config = {"config": spec.cell_config(value, "headless", 0).to_dict(), "value": value}
        return SimpleNamespace(metrics=metrics, config=config, error=error, path=str(tmp_path))

    rows = _rows([result(512, {"trial_id": "t1", "trial/error": nan}),
                  result(1024, {"trial_id": "t2", "trial/error": nan})], spec, runtime,
                 search=False)  # fmt: skip
    assert [(r["status"], r["error"][:30]) for r in rows] == [("FAILED", nan[:30])] * 2
    assert sweep_status(rows, interrupted=False) == ("FAILED", "0 of 2 trial(s) finished, 2 failed")
    assert sweep_status(rows, interrupted=True)[0] == "KILLED"
    advice = failure_advice(rows)
    assert "2 trial(s) diverged" in advice and "lower optim.lr" in advice
    assert "another --name" in advice and "re-run the same command" not in advice

    lost = {"trial_id": "t3"}
    mixed = _rows([result(512, {"trial_id": "t1", "trial/error": nan}),
                   result(1024, lost, RuntimeError("node lost"))], spec, runtime, search=False)  # fmt: skip
    advice = failure_advice([r for r in mixed if r["status"] == "FAILED"])
    assert "1 trial(s) diverged" in advice and "1 trial(s) did not finish" in advice
    ok = {"trial_id": "t1", "downstream/score": 0.5}
    assert sweep_status(_rows([result(512, ok)], spec, runtime, search=False), False)[0] == (
        "FINISHED"
    )


def test_sweep_spec_validates_settings():
    with pytest.raises(HLMError, match="sweep.num_seeds=0"):
        SweepSpec(axis=VOCAB.AXIS, base="tiny-encoder", values=(512,), num_seeds=0)
    with pytest.raises(HLMError, match="unknown objective 'cwt'"):
        SweepSpec(axis=VOCAB.AXIS, base="tiny-encoder", values=(512,), objectives=("cwt",))


# ------------------------------------------------------------------------------ end to end


def test_a_run_name_prefix_defaults_to_the_axis_names_first_letter():
    from hlm_ray.tune.axis import Axis

    assert Axis("toy", "optim.lr", "learning rate", ("lr", "lr")).short == "t"
    assert SCRIPTS["headline"].AXIS.short == "f"  # f for family, as its runs were named


def _hlm_sweep_parser(kind: str):
    """The parser of `hlm sweep <kind>`, as `hlm` builds it."""
    from hlm_ray.cli import build_parser

    def sub(parser):
        return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")

    return sub(sub(build_parser()).choices["sweep"]).choices[kind]


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_hlm_sweep_accepts_every_flag_of_the_script(kind):
    def flags(parser):
        return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}

    script = SCRIPTS[kind].SCRIPT
    assert flags(_hlm_sweep_parser(kind)) == flags(script.parser()) >= {"--preset", "--dry-run"}


def test_hlm_sweep_headline_curve_is_the_scripts_curve(capsys):
    from hlm_ray.cli import main

    argv = ["--preset", "tiny", "--curve", "--dry-run"]
    assert SCRIPTS["headline"].main(argv) == 0
    expected = capsys.readouterr().out
    assert main(["sweep", "headline", *argv]) == 0
    assert capsys.readouterr().out == expected
    assert "plan for headline-tiny-curve: 4 trial(s)" in expected
    assert "headline=tiny-encoder-curve" in expected and "headline=tiny-gpt2" not in expected


def test_a_scripts_report_follows_its_grid_sweep_only(monkeypatch, tmp_path, capsys):
    import hlm_ray.tune.sweep as sweep
    from hlm_ray.tune.cli import SweepScript

    def finished(spec, *, name, search, assumptions=None, storage_path=None, verbose=0):
        rows = [{"status": "FINISHED", "trial_id": "t0", "loss": 1.0, "lr": 1e-3}]
        rows[0]["warmup_steps"] = 10
        print("a line for the sweep's log")
        outcome = sweep.SweepOutcome(name, tmp_path, rows, "| table |", [], None, False, 1.0)
        outcome.link = "MLflow: open this"
        return outcome

    written = []

    def report(spec, name, preset):
        written.append((spec.values, spec.num_seeds, name, preset))
        (tmp_path / "report.md").write_text("# the report\n")
        return [tmp_path / "report.md", tmp_path / "fig.png"]

    monkeypatch.setattr(sweep, "run_sweep", finished)
    monkeypatch.chdir(tmp_path)
    main = SweepScript(VOCAB.AXIS, VOCAB.PRESETS, report=report).main
    assert main(["--set", "sweep.values=[512]", "--num-seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert written == [((512,), 2, "vocab-tiny", "tiny")]  # the spec the sweep ran
    assert out.index("| table |") < out.index("# the report") < out.index("report: ")
    assert out.rstrip().endswith("MLflow: open this")  # the link comes last
    assert "a line for the sweep's log" not in out  # it went to the log
    assert (
        "a line for the sweep's log" in (tmp_path / "runs/sweeps/vocab-tiny/sweep.log").read_text()
    )
    assert main(["--search", "--set", "sweep.values=[512]"]) == 0
    assert main(["--dry-run", "--set", "sweep.values=[512]"]) == 0
    assert len(written) == 1 and "# the report" not in capsys.readouterr().out


def test_a_stopped_trials_run_stays_killed_when_its_process_says_failed_late(
    mlflow_store, tmp_path
):
    """The trial's process, going down, can still write FAILED just after the sweep marked its
    run KILLED (seen in CI): the sweep reads the run back for KILL_SETTLE_S and marks it
    again. A real sqlite store; the late write comes from a thread, 1 s after."""
    import threading
    import time

    from mlflow import MlflowClient

    from hlm_ray.tracking import MlflowTracker, write_run_ref

    trial = MlflowTracker("close-orphans", run_name="stopped", tracking_uri=mlflow_store)
    write_run_ref(tmp_path / "stopped", trial.run_id, mlflow_store)
    spec = SimpleNamespace(experiment="close-orphans")
    runtime = SimpleNamespace(trials_dir=str(tmp_path), env={"MLFLOW_TRACKING_URI": mlflow_store})
    client = MlflowClient(mlflow_store)

    def late_failed():
        time.sleep(1.0)
        client.set_terminated(trial.run_id, "FAILED")  # past finish's check, as in the race

    late = threading.Thread(target=late_failed)
    late.start()
    _close_orphans([{"status": "STOPPED", "run": "stopped"}], spec, runtime)
    late.join()
    assert client.get_run(trial.run_id).info.status == "KILLED"
    assert read_run_ref(tmp_path / "stopped")["status"] == "KILLED"


class Forwarder:
    """A TCP forwarder on a port of its own to the server at `target` (host, port), which can
    go down (its listener and every connection closed, as a server process killed) and come
    back on the same port (the server started again): a real outage between a client and a
    real MLflow server, without stopping the session's server."""

    def __init__(self, target: tuple[str, int]):
        import socket
        import threading

        self.target, self.socket, self.threading = target, socket, threading
        self.port, self.open = 0, []
        self.up()

    def up(self) -> None:
        self.listener = self.socket.create_server(("127.0.0.1", self.port))
        self.port = self.listener.getsockname()[1]
        self.threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self) -> None:
        for sock in [self.listener, *self.open]:
            with contextlib.suppress(OSError):
                sock.shutdown(self.socket.SHUT_RDWR)  # wakes the threads blocked on it
            sock.close()
        self.open = []

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: down
                return
            server = self.socket.create_connection(self.target)
            self.open += [client, server]
            for a, b in ((client, server), (server, client)):
                self.threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        sink.close()


def test_the_end_of_a_sweep_closes_a_parent_run_whose_server_went_away_meanwhile(
    mlflow_server, tmp_path, capsys
):
    """The tracking server killed and started again during a sweep: the parent run's tracker
    had turned off at its first failed call, and the sweep's end left the parent RUNNING with
    only plan.txt. Reopened with a new client, it takes the results and is closed; a server
    still down is one line that names what finishes the job, `hlm sync <sweep folder>`, which
    then sends the trials' records and the parent's files and closes it."""
    import urllib.parse

    from mlflow import MlflowClient

    from hlm_ray.cli import main
    from hlm_ray.tracking import MlflowTracker, write_run_ref
    from hlm_ray.tune.replay import reopened, say_if_unclosed

    address = urllib.parse.urlsplit(mlflow_server)
    outage = Forwarder((address.hostname, address.port))
    uri = f"http://127.0.0.1:{outage.port}"
    parent = MlflowTracker(EXPERIMENT, "outage-parent", tracking_uri=uri)
    outage.down()  # killed mid-sweep: the parent's next call fails, its tracker turns off
    parent.log_metrics({"trials_finished": 2}, step=0)
    assert not parent.active and reopened(parent) is parent  # still down: as it is
    say_if_unclosed(parent, tmp_path / "sweep")
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and f"`hlm sync {tmp_path / 'sweep'}`" in said
    outage.up()  # started again
    again = reopened(parent)
    again.log_metrics({"trials_finished": 2}, step=0)
    again.finish("FINISHED")
    client = MlflowClient(mlflow_server)
    run = client.get_run(parent.run_id)
    assert (run.info.status, run.data.metrics) == ("FINISHED", {"trials_finished": 2.0})

    # A sweep whose end met the outage: its folder has the summary and a trial's scores that
    # MLflow lacks; `hlm sync` of the folder sends them and closes the parent.
    folder = tmp_path / "runs" / "sweeps" / "outage"
    spec = {"experiment": EXPERIMENT}
    (folder / "trials").mkdir(parents=True)
    state = {"spec": spec, "search": False, "parent_run_id": parent.run_id, "results": {}}
    (folder / "sweep.json").write_text(json.dumps(state))
    (folder / "summary.csv").write_text("run,status\nheadless-v1-s0-a,FINISHED\n")
    (folder / "summary.md").write_text("| run |\n")
    child = MlflowTracker(EXPERIMENT, "headless-v1-s0-a", tracking_uri=mlflow_server)
    trial = folder / "trials" / "headless-v1-s0-a"
    JsonlTracker(trial).log_metrics({"train/loss": 2.0}, step=1)
    write_run_ref(trial, child.run_id, mlflow_server)
    (trial / "downstream.json").write_text('{"downstream/score": 0.5}')
    MlflowTracker(EXPERIMENT, run_id=parent.run_id, tracking_uri=mlflow_server)  # RUNNING
    assert main(["sync", str(folder), "--tracking-uri", mlflow_server]) == 0
    assert "2 metric point(s) of 1 trial(s), 2 file(s)" in capsys.readouterr().out
    run = client.get_run(parent.run_id)
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.run_id)} == {"summary.csv", "summary.md"}
    assert client.get_run(child.run_id).data.metrics == {"train/loss": 2.0, "downstream/score": 0.5}


@pytest.fixture(scope="module")
def sweep_server(mlflow_server):
    """The module's sweeps log through the session's MLflow server."""
    with pytest.MonkeyPatch.context() as patch:
        use_mlflow_server(mlflow_server, patch.setenv)
        yield mlflow_server


@pytest.mark.slow
def test_a_temporary_server_prints_no_links_that_die_with_it(sweep_server, capsys):
    """MLflow prints "View run ... at: <server>" when a run ends on an HTTP store; the sweep's
    own server is gone minutes later, so while it runs those lines are off."""
    from hlm_ray.tracking import MlflowTracker

    run = MlflowTracker(EXPERIMENT, "quiet", tracking_uri=sweep_server)
    run.finish()
    assert run.active and "View run" not in capsys.readouterr().out


@pytest.mark.ray
@pytest.mark.slow
def test_vocab_sweep_end_to_end_then_resumes_without_retraining(
    ray_cluster, sweep_server, mlflow_store, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    main = _sweep_main("vocab")
    # The demo's sizes (up to 32k) cost minutes; the machinery is the same at 512 and 1024.
    items = [*FAST, "sweep.values=[512,1024]"]
    argv = ["--preset", "tiny", "--name", "vocab-e2e", *_set(items)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    folder = tmp_path / "runs" / "sweeps" / "vocab-e2e"
    spec = get_sweep("vocab", "tiny", items)
    rows = check_trials_carry_their_values(folder, spec, sweep_server, "vocab-e2e")
    assert sorted((r["objective"], r["vocab_size"]) for r in rows) == [
        ("headless", "1024"),
        ("headless", "512"),
        ("vanilla", "1024"),
        ("vanilla", "512"),
    ]
    for row in rows:
        assert row["status"] == "FINISHED", row
        assert float(row["V"]) == float(row["vocab_size"])
        assert float(row["K_over_V"]) == pytest.approx(float(row["K"]) / float(row["V"]))
        assert float(row["tokens_per_s"]) > 0 and 0 <= float(row["downstream/score"]) <= 1
        assert 0 < float(row["head_flop_share"]) < 1
    # The vanilla MLM has a head: its masked-token bits per byte; a headless encoder has none.
    assert all((r["token_bpb"] != "") == (r["objective"] == "vanilla") for r in rows)

    client, parents, children = _runs(sweep_server, "vocab-e2e")
    (parent,) = parents
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "summary.csv",
        "summary.md",
        "fig7a_score_vs_vocab.png",
        "fig7b_tokens_per_s_vs_vocab.png",
        "plan.txt",
    }
    # The plan before the trials, the measured figures beside it at the end.
    metrics = set(parent.data.metrics)
    assert {"plan/flops", "plan/wall_s", "measured/wall_s"} <= metrics
    assert "plan/cpu_hours" in metrics or "plan/gpu_hours" in metrics  # priced where it runs
    assert parent.data.metrics["measured/mean_overhead_s"] > 0
    # The results as charts (one step per vocabulary size) and the description; the link printed
    # is the parent run's page on the store's server, MLflow's own links are off.
    for objective in ("headless", "vanilla"):
        history = client.get_metric_history(
            parent.info.run_id, f"ablation/downstream_score/{objective}"
        )
        assert sorted(m.step for m in history) == [512, 1024]
    assert (
        "| vocab (asked) | downstream score, headless |" in parent.data.tags["mlflow.note.content"]
    )
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert f"/#/experiments/{experiment.experiment_id}/runs/{parent.info.run_id}" in printed
    assert "View run" not in printed
    assert len(children) == 4
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED"
        assert "downstream/score" in child.data.metrics and "train/loss" in child.data.metrics
        # Where the trial's time went, and the measured U of the FLOP model.
        times = child.data.metrics
        assert 0 < times["trial/train_s"] < times["trial/wall_s"]
        assert times["trial/overhead_s"] == pytest.approx(
            times["trial/wall_s"] - times["trial/train_s"]
        )
        assert 1 < times["train/U"] <= times["train/K"]
        assert child.data.params["objective.name"] == child.data.tags["objective"]
        assert child.data.tags["ray_train"] == "local"  # one CPU worker: in the trial's process
        assert {"model", "config.yaml", "loss_curve.png"} <= {
            a.path for a in client.list_artifacts(child.info.run_id)
        }
    # The store the server wrote is the sqlite file `mlflow ui` reads.
    assert len(_runs(mlflow_store, "vocab-e2e")[2]) == 4

    # Same name again: Tune restores the finished trials; nothing is trained again. One trial's
    # folder has a step MLflow never got, as a worker that outlived a SIGKILLed sweep writes it
    # with the sweep's tracking server gone: the resumed sweep sends it, though it runs no trial.
    models = sorted((folder / "trials").glob("*/model/model.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in models]
    assert len(models) == 4
    JsonlTracker(models[0].parents[1]).log_metrics({"train/loss": 9.5}, step=9)
    capsys.readouterr()
    assert main(argv) == 0
    assert "MLflow lacked 1 metric point(s) of trial" in capsys.readouterr().out
    check_trials_carry_their_values(folder, spec, sweep_server, "vocab-e2e")
    assert [p.stat().st_mtime_ns for p in models] == stamps
    assert len(_runs(sweep_server, "vocab-e2e")[2]) == 4
    assert [r["trial_id"] for r in _summary(folder)] == [r["trial_id"] for r in rows]
    assert main([*argv, "--set", "sweep.values=[512]"]) == 2  # another grid, same name


@pytest.mark.ray
def test_a_downstream_step_whose_process_is_lost_runs_again_in_a_new_one(
    ray_cluster, tmp_path, capsys
):
    """The step's actor dies (as with its node, which the cluster box cuts): it starts again in
    a new actor, and says so; its own errors are not retried; attempts are bounded."""
    import ray

    from hlm_ray.tune.remote_step import run_on_a_node

    def _dies_once(marker: str) -> str:  # defined here: sent to the actor by value
        import os
        from pathlib import Path

        if not Path(marker).exists():
            Path(marker).touch()
            os._exit(1)
        return "scored"

    def _raises() -> None:
        raise ValueError("not a node's loss: the step's own error")

    marker = str(tmp_path / "died-once")
    assert run_on_a_node(_dies_once, (marker,), cpus=1, gpus=0, attempts=2) == "scored"
    assert "starting it again on a node with room (attempt 2 of 2)" in capsys.readouterr().out
    with pytest.raises(ray.exceptions.RayActorError):
        run_on_a_node(_dies_once, (str(tmp_path / "dies"),), cpus=1, gpus=0, attempts=1)
    with pytest.raises(ray.exceptions.RayTaskError, match="not a node"):
        run_on_a_node(_raises, (), cpus=1, gpus=0, attempts=3)
    assert "starting it again" not in capsys.readouterr().out


@pytest.mark.ray
@pytest.mark.slow
def test_ctrl_c_before_the_trials_start_leaves_the_parent_run_killed(
    ray_cluster, sweep_server, tmp_path, monkeypatch, capsys
):
    """The parent run is opened seconds before Tune starts (the plan is logged, the grid
    prepared): a Ctrl-C there ends it KILLED with the command to continue, never RUNNING."""
    from hlm_ray import plan

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan, "log_sweep_plan", interrupted)
    argv = ["--preset", "tiny", "--name", "vocab-window", *_set([*FAST, "sweep.values=[512]"])]
    assert _sweep_main("vocab")(argv) == 130
    assert "continue with: " in capsys.readouterr().err
    _, parents, children = _runs(sweep_server, "vocab-window")
    assert [p.info.status for p in parents] == ["KILLED"] and not children


@pytest.mark.ray
@pytest.mark.slow
def test_batch_size_sweep_retries_a_failed_trial_from_its_checkpoint(
    ray_cluster, sweep_server, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    # Every trial's worker dies once at step 4, after the checkpoint at step 4; Tune retries
    # the trial (same id, same run folder) and training continues from that checkpoint. One
    # arm, both batch sizes: the retry does not depend on the objective, and each retried trial
    # costs a second worker-group start (~40 s on 2 cores); the vanilla decoder's LAMBADA step
    # runs in test_headline.py's end-to-end sweep.
    items = [*FAST, "run.checkpoint_every=4", "run.fail_at_step=4", "sweep.objectives=[headless]"]
    argv = ["--preset", "tiny", "--name", "bs-e2e", "--max-failures", "1", *_set(items)]
    assert _sweep_main("batch_size")(argv) == 0
    folder = tmp_path / "runs" / "sweeps" / "bs-e2e"
    rows = check_trials_carry_their_values(
        folder, get_sweep("batch_size", "tiny", items), sweep_server, "bs-e2e"
    )
    assert sorted((r["objective"], r["micro_batch"]) for r in rows) == [
        ("headless", "16"),
        ("headless", "8"),
    ]
    assert all(r["status"] == "FINISHED" and r["lambada/accuracy"] != "" for r in rows)
    # K is the in-batch rows of one micro-batch: B·(L−1) targets of a decoder.
    assert {int(r["micro_batch"]) * 63 for r in rows} == {int(float(r["K"])) for r in rows}
    for trial in (folder / "trials").iterdir():
        assert (trial / ".failed_at_4").exists()  # it did fail once

    client, (parent,), children = _runs(sweep_server, "bs-e2e")
    assert "fig8_lambada_vs_batch_size.png" in {
        a.path for a in client.list_artifacts(parent.info.run_id)
    }
    assert len(children) == 2  # the retry continued each trial's run
    for child in children:
        micro = int(child.data.params["optim.micro_batch_size"])
        assert int(child.data.params["optim.global_batch_size"]) == micro  # one worker
        steps = {m.step for m in client.get_metric_history(child.info.run_id, "train/loss")}
        assert steps == {4, 8}
        assert "lambada/accuracy" in child.data.metrics


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_whose_trial_diverges_fails_once_and_says_why(
    ray_cluster, sweep_server, tmp_path, monkeypatch, capsys
):
    """`python sweeps/temperature.py --preset tiny --set optim.lr=1e4`: each trial diverged,
    was started twice, and the parent ended FINISHED with advice to re-run the same command. One
    trial here (local mode: no worker group to start), `--max-failures 1`."""
    monkeypatch.chdir(tmp_path)
    items = [*FAST, "optim.lr=1e30", "sweep.values=[1.0]"]
    argv = ["--preset", "tiny", "--name", "div", "--max-failures", "1", *_set(items)]
    assert _sweep_main("temperature")(argv) == 1
    out = capsys.readouterr().out
    assert out.count("started: temperature=1 headless") == 1, out  # not retried
    assert "failed: training diverged: the loss is" in out
    assert "1 trial(s) diverged" in out and "re-run the same command" not in out
    client, (parent,), (child,) = _runs(sweep_server, "div")
    assert parent.info.status == "FAILED" and child.info.status == "FAILED"
    assert parent.data.tags["sweep_outcome"] == "0 of 1 trial(s) finished, 1 failed"


@pytest.mark.ray
@pytest.mark.slow
def test_search_stops_trials_with_asha_and_names_the_lowest_validation_loss(
    ray_cluster, sweep_server, tmp_path, monkeypatch, capsys
):
    """--search for real: 2 sampled learning rates, one trial at a time (1.2 CPUs a worker on
    the 2-CPU session cluster: ASHA sees the trials in a fixed order), a validation loss at
    every third step, ASHA from the first report on."""
    monkeypatch.chdir(tmp_path)
    items = [
        "optim.max_steps=12",
        "run.checkpoint_every=3",
        "run.log_every=3",
        "tokenizer.train_sample_bytes=300000",
        "sweep.search_samples=2",
        "sweep.search_lr=[1e-5,1e-1]",
        "sweep.search_warmup=[0,2]",
        "sweep.recipe=none",
        "sweep.cpus_per_worker=1.2",
    ]
    argv = ["--preset", "tiny", "--search", "--name", "search-e2e", *_set(items)]
    assert _sweep_main("vocab")(argv) == 0
    printed = capsys.readouterr().out
    rows = _summary(tmp_path / "runs" / "sweeps" / "search-e2e")
    status = {r["trial_id"]: r["status"] for r in rows}
    stopped = sorted(t for t, s in status.items() if s == "STOPPED")
    finished = sorted(t for t, s in status.items() if s == "FINISHED")
    assert len(rows) == 2 and stopped and finished, status
    assert len({r["lr"] for r in rows}) == 2  # each trial its own sample
    assert f"{len(stopped)} trial(s) stopped early by ASHA: {', '.join(stopped)}" in printed

    # Every trial's validation loss, read from its own MLflow run.
    client, (parent,), children = _runs(sweep_server, "search-e2e")
    assert parent.info.status == "FINISHED"
    runs = {c.data.tags["trial_id"]: c for c in children}
    assert sorted(runs) == sorted(status)
    assert {c.data.tags["ray_train"] for c in children} == {"workers"}  # ASHA: a worker group
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)

    def val_steps(trial):
        history = client.get_metric_history(runs[trial].info.run_id, "val/loss")
        return {m.step: m.value for m in history}

    last = {}  # every trial's last validation loss
    for trial in stopped:  # its run closed KILLED, as its folder says (for `hlm sync`)
        steps = val_steps(trial)
        assert runs[trial].info.status == "KILLED" and steps
        row = next(r for r in rows if r["trial_id"] == trial)
        trial_dir = tmp_path / "runs" / "sweeps" / "search-e2e" / "trials" / row["run"]
        assert read_run_ref(trial_dir)["status"] == "KILLED"
        last[trial] = steps[max(steps)]
    losses = {}
    for trial in finished:
        steps = val_steps(trial)
        assert max(steps) == 12 and runs[trial].info.status == "FINISHED"
        losses[trial] = steps[12]
        row = next(r for r in rows if r["trial_id"] == trial)
        assert float(row["loss"]) == pytest.approx(losses[trial])
    best = min(losses, key=losses.get)
    (line,) = [line for line in printed.splitlines() if line.startswith("best: ")]
    assert f"validation loss {losses[best]:.4f}" in line and line.endswith(f"trial {best})")
    assert losses[best] == min({**last, **losses}.values())  # ASHA stopped trailing trials
