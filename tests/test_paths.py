"""Where things land: relative outputs and the embedded MLflow store follow the current
directory (as `mlflow` and Ray do), never the package's folder; inside Ray's copy of a job's
working dir they go to the checkout the package was installed from."""

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hlm_ray import paths
from hlm_ray.paths import PROJECT_ROOT, resolve_output, work_dir


@pytest.fixture
def no_overrides(monkeypatch):
    for key in ("HLM_WORK_DIR", "HLM_MLFLOW_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)


def test_outputs_follow_the_current_directory(no_overrides, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert work_dir() == tmp_path.resolve()
    assert resolve_output("runs/a") == tmp_path.resolve() / "runs" / "a"
    assert resolve_output(tmp_path / "abs") == tmp_path / "abs"
    monkeypatch.setenv("HLM_WORK_DIR", str(tmp_path / "elsewhere"))
    assert resolve_output("runs/a") == tmp_path / "elsewhere" / "runs" / "a"


def _ray_copy(tmp_path: Path) -> Path:
    """A folder shaped like the one `ray job submit --working-dir .` runs a job in."""
    copy = tmp_path / "ray" / "session_x" / "runtime_resources" / "working_dir_files" / "_pkg"
    copy.mkdir(parents=True)
    return copy


def test_a_ray_job_copy_writes_to_the_installed_checkout(no_overrides, monkeypatch, tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(_ray_copy(tmp_path))
    monkeypatch.setattr(paths, "_installed_source_root", lambda: checkout)
    assert resolve_output("runs/job") == checkout / "runs" / "job"

    from hlm_ray.tracking import default_tracking_uri

    assert default_tracking_uri() == f"sqlite:///{checkout / 'mlflow.db'}"


def test_a_ray_job_copy_without_a_checkout_says_how_to_keep_results(
    no_overrides, monkeypatch, tmp_path, caplog
):
    copy = _ray_copy(tmp_path)
    monkeypatch.chdir(copy)
    monkeypatch.setattr(paths, "_installed_source_root", lambda: None)
    monkeypatch.setattr(paths, "_warned_copy", False)
    with caplog.at_level(logging.WARNING, logger="hlm_ray.paths"):
        assert work_dir() == copy.resolve()
        assert work_dir() == copy.resolve()  # warned once
    (message,) = [r.getMessage() for r in caplog.records]
    assert "HLM_WORK_DIR" in message and "deleted when the job ends" in message
    monkeypatch.setenv("HLM_WORK_DIR", str(tmp_path / "results"))
    assert resolve_output("runs/job") == tmp_path / "results" / "runs" / "job"


def test_an_installed_package_writes_where_it_is_run(no_overrides, tmp_path):
    """The package copied into a site-packages-like folder (what a non-editable install
    leaves), imported from another directory: the store and runs/ are in that directory."""
    site = tmp_path / "site-packages"
    shutil.copytree(
        PROJECT_ROOT / "hlm_ray", site / "hlm_ray", ignore=shutil.ignore_patterns("__pycache__")
    )
    user = tmp_path / "my project"
    user.mkdir()
    code = (
        "import hlm_ray.paths as p, hlm_ray.tracking as t; "
        "print(p.PROJECT_ROOT); print(t.default_tracking_uri()); print(p.resolve_output('runs/x'))"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=user, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [str(site), f"sqlite:///{user / 'mlflow.db'}", str(user / "runs" / "x")]
