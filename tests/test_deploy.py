"""Every file in deploy/ is loaded and checked: the Serve config against Serve's own schema and
the app's typed arguments, the KubeRay manifests against the CRDs' OpenAPI schemas (as
`kubectl apply` would, unknown fields included), and every script, path and command they
reference."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml

from hlm_ray.paths import project_root

ROOT = project_root()
DEPLOY = ROOT / "deploy"
# The KubeRay CRDs live beside the data folder (../shared/schemas/kuberay), not in the repo.
CRDS = ROOT.parent / "shared" / "schemas" / "kuberay"
KUBERAY = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices"}
MANIFESTS = {
    "kuberay/raycluster.yaml": "RayCluster",
    "kuberay/rayjob-vocab-sweep.yaml": "RayJob",
    "kuberay/rayservice.yaml": "RayService",
    "kuberay/rayservice-vllm.yaml": "RayService",
}
TRACKING_URI = "http://mlflow.mlflow.svc.cluster.local:5000"

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(rel: str) -> dict:
    return yaml.load((DEPLOY / rel).read_text(), Loader=_Loader)


def _crd_schema(kind: str, api_version: str) -> dict:
    path = CRDS / f"ray.io_{KUBERAY[kind]}.yaml"
    if not path.is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRDS}")
    crd = yaml.load(path.read_text(), Loader=_Loader)
    version = api_version.split("/")[-1]
    [entry] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert entry["served"], f"{kind} {version} is not served by this KubeRay"
    return entry["schema"]["openAPIV3Schema"]


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not declare (kubectl's strict field validation rejects them)."""
    if isinstance(obj, dict):
        props = schema.get("properties")
        if props is None or schema.get("x-kubernetes-preserve-unknown-fields"):
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                return [f for k, v in obj.items() for f in unknown_fields(v, extra, f"{path}.{k}")]
            return []
        found = []
        for key, value in obj.items():
            if key not in props:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(value, props[key], f"{path}.{key}")
        return found
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [
            f for i, v in enumerate(obj) for f in unknown_fields(v, schema["items"], f"{path}[{i}]")
        ]
    return []


def crd_errors(manifest: dict) -> list[str]:
    schema = _crd_schema(manifest["kind"], manifest["apiVersion"])
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(manifest)
    ]
    return errors + [f"{f}: unknown field" for f in unknown_fields(manifest, schema)]


def _containers(manifest: dict) -> list[dict]:
    spec = manifest["spec"]
    cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
    pods = [cluster["headGroupSpec"]] + cluster.get("workerGroupSpecs", [])
    return [c for pod in pods for c in pod["template"]["spec"]["containers"]]


def _serve_config_v2() -> dict:
    return yaml.safe_load(_load("kuberay/rayservice.yaml")["spec"]["serveConfigV2"])


# ----------------------------------------------------------------------------- inventory


BOX = ("box/box.py", "box/scenarios.py", "box/view.py", "box/load.py")
"""The cluster in a box's scripts: run by tests/test_cluster_box.py (two scenarios) and loaded
here."""
BOX_PARTS = (
    "box/nodes.py", "box/services.py", "box/client.py", "box/jobs.py", "box/cuts.py",
    "box/outages.py",
)  # fmt: skip
"""What the scripts import: the box's nodes and services, the client's tools, the scenarios."""


def test_every_file_in_deploy_is_checked_here():
    files = {
        str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert files == {"README.md", "serve.yaml", "serve-vllm.yaml", *MANIFESTS, *BOX, *BOX_PARTS}, (
        "a new file in deploy/ needs a check in tests/test_deploy.py"
    )


def test_the_box_scripts_load_and_name_their_scenarios(monkeypatch):
    """Every script of deploy/box imports, has its entry point, and the scenarios the docs
    table names are the ones `scenarios.py --only` accepts; every part it imports imports."""
    monkeypatch.syspath_prepend(str(DEPLOY / "box"))
    modules = {
        rel: importlib.import_module(rel.split("/")[1].removesuffix(".py"))
        for rel in (*BOX, *BOX_PARTS)
    }
    for rel in BOX:
        assert callable(modules[rel].main), rel
    scenarios = modules["box/scenarios.py"]
    table = re.findall(r"^\| ([\w, +-]+) \|", scenarios.__doc__, re.M)[1:]  # not the header
    named = {n.strip() for row in table for n in row.split(",")}
    assert named == set(scenarios.SCENARIOS), named


def test_the_box_runs_what_a_chosen_scenario_needs_first(monkeypatch, capsys):
    """`--only serve` alone used to fail on a fresh box (no registered model); now it brings
    registry, which brings train-s3, and each lands in a group before its user's."""
    monkeypatch.syspath_prepend(str(DEPLOY / "box"))
    scenarios = importlib.import_module("scenarios")
    chosen = scenarios.with_needs(["serve", "partition"])
    assert sorted(chosen) == ["partition", "registry", "serve", "train-s3"]
    assert "serve needs registry of the same run" in capsys.readouterr().out
    order = scenarios.batches(chosen, serial=False)
    assert order == [["train-s3"], ["registry"], ["serve+partition"]]
    assert scenarios.with_needs(["sweep-resume"]) == ["sweep-resume", "sweep-s3"]
    assert scenarios.with_needs(["serve"], reuse=True) == ["serve"]  # the box's registry has one
    for name, need in scenarios.NEEDS.items():
        order = scenarios.batches(scenarios.with_needs([name]), serial=True)
        where = {n: i for i, group in enumerate(order) for n in group}
        assert where[need] < where[name], (name, order)


def test_the_box_takes_its_folder_before_or_after_the_command(monkeypatch):
    """`box.py up --root X` ignored --root (the command's remainder swallowed it) and removed
    the box at the default root; a --root after `client --` is the client command's own."""
    monkeypatch.syspath_prepend(str(DEPLOY / "box"))
    box = importlib.import_module("box")
    for argv in (["up", "--root", "/x"], ["--root", "/x", "up"], ["status", "--root", "/x"]):
        assert box.parse(argv).root == Path("/x"), argv
    assert box.parse(["down"]).root == Path(box.ROOT)
    given = box.parse(["client", "--root", "/x", "--", "ray", "job", "list", "--root", "y"])
    assert (given.root, given.rest) == (Path("/x"), ["ray", "job", "list", "--root", "y"])
    assert box.parse(["node", "w1", "ls", "-l"]).rest == ["w1", "ls", "-l"]


def test_a_box_node_keeps_a_checkout_and_virtualenv_that_live_under_tmp(monkeypatch, tmp_path):
    """Each node mounts a tmpfs over /tmp (and ~/.cache): a checkout or virtualenv there was
    hidden, and the box failed naming its buckets. The node's mounts, run in a mount namespace
    of their own, from pytest's folder under /tmp: the checkout (copy-on-write), the
    virtualenv and the shared data are there; the machine's data folder and /tmp are not."""
    monkeypatch.syspath_prepend(str(DEPLOY / "box"))
    nodes = importlib.import_module("nodes")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux's unshare (as the box does)")
    assert str(tmp_path).startswith("/tmp/")
    checkout, venv, data, shared = (tmp_path / n for n in ("checkout", "venv", "data", "shared"))
    for folder in (checkout, venv / "bin", data, shared / "data", tmp_path / "private" / "upper",
                   tmp_path / "private" / "work"):  # fmt: skip
        folder.mkdir(parents=True)
    (checkout / "marker").write_text("checkout\n")
    (venv / "bin" / "python").write_text("#!/bin/sh\necho venv\n")
    (venv / "bin" / "python").chmod(0o755)
    (data / "corpus.txt").write_text("data\n")
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    mounts = nodes.pod_mounts("w1", tmp_path / "hosts", shared, data, tmp_path / "private",
                              checkout=checkout, keep=(venv,))  # fmt: skip
    checks = [
        f"cat {checkout}/marker",
        f"{venv}/bin/python",
        "cat /mnt/shared/data/corpus.txt",
        f"test ! -e {data}/corpus.txt",  # the machine's own copy, hidden
        f"touch {checkout}/written-on-the-node",
        f"ls {tmp_path}",  # /tmp is the node's own: only what it keeps is there
    ]
    script = " && ".join([*mounts, *checks])
    done = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", script],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["checkout", "venv", "data", "checkout", "venv"], done.stdout
    assert not (checkout / "written-on-the-node").exists()  # in the node's upper layer
    assert (tmp_path / "private" / "upper" / "written-on-the-node").exists()


def test_a_box_s_teardown_removes_its_namespaces_and_leaves_others_with_its_prefix(monkeypatch):
    """Found when the suite ran the box beside tests/test_ray_ports.py: the box test's teardown
    of whatever a killed run left (every namespace starting `hlmtest-`) killed the processes of
    that test's `hlmtest-ports-...` namespace. Only the box's own names go now."""
    monkeypatch.syspath_prepend(str(DEPLOY / "box"))
    box = importlib.import_module("box")
    prefix = f"hlmt{uuid.uuid4().hex[:5]}"
    mine, other = f"{prefix}-w1", f"{prefix}-ports-1"
    if subprocess.run(["ip", "netns", "add", mine], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here (needs root and iproute2)")
    try:
        subprocess.run(["ip", "netns", "add", other], check=True)
        assert box.leftovers(prefix) == [mine]
        box.teardown(prefix)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in listed.splitlines()}
        assert mine not in names and other in names
    finally:
        for netns in (mine, other):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)


# ----------------------------------------------------------------------------- serve.yaml


def _check_serve_config(config: dict) -> dict:
    """Serve's own schema, the import path, the typed args and the deployment names; returns
    the application."""
    from ray.serve.schema import ServeDeploySchema

    from hlm_ray.serve.schemas import AppArgs

    ServeDeploySchema.model_validate(config)
    [app] = config["applications"]
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert callable(builder)
    [param] = inspect.signature(builder).parameters.values()
    assert param.annotation is AppArgs  # Serve validates `args` into it
    AppArgs.model_validate(app["args"])
    AppArgs.model_validate({**app["args"], "model": "runs/any-run"})
    served = {importlib.import_module(module).CompletionServer.name}
    assert {d["name"] for d in app["deployments"]} <= served
    return app


def test_serve_yaml_is_a_valid_serve_config_for_the_app():
    config = _load("serve.yaml")
    app = _check_serve_config(config)
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000, "keep_alive_timeout_s": 5}
    assert app["args"]["model"].startswith("models:/")
    [deployment] = app["deployments"]
    assert deployment["max_ongoing_requests"] >= app["args"]["max_batch_size"]
    assert deployment["max_queued_requests"] > 0  # overload answers 503, not an endless queue
    # Its ray_actor_options replace the deployment's own: they keep the replica's niceness.
    env = deployment["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env == {"RAY_worker_niceness": "0"}


def test_serve_yaml_with_a_missing_model_fails_with_the_reason(tmp_path):
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from hlm_ray.errors import HLMError
    from hlm_ray.serve.app import build_app

    [app] = _load("serve.yaml")["applications"]
    args = {**app["args"], "model": str(tmp_path / "no-such-run")}
    with pytest.raises(HLMError, match="no-such-run does not exist"):
        call_user_app_builder_with_args_if_necessary(build_app, args)


def _check_vllm_config(config: dict, tmp_path: Path, tiny_decoder_dir: str) -> dict:
    """Serve's schema, the builder typed with `VllmArgs`, and deployment names that are the
    ones the builder makes (built here on a local model: the registry is not reachable)."""
    from ray.serve.schema import ServeDeploySchema

    from hlm_ray.serve.vllm.app import VllmArgs, build_app

    ServeDeploySchema.model_validate(config)
    [app] = config["applications"]
    assert app["import_path"] == "hlm_ray.serve.vllm.app:build_app"
    [param] = inspect.signature(build_app).parameters.values()
    assert param.annotation is VllmArgs
    args = VllmArgs.model_validate(app["args"])
    assert args.model.startswith("models:/") and args.api_key is None
    built = build_app({**app["args"], "model": tiny_decoder_dir, "device": "auto", "num_gpus": 0})
    names = {built._bound_deployment.name} | {
        arg._bound_deployment.name
        for arg in built._bound_deployment.init_kwargs["llm_deployments"].values()
    }
    assert {d["name"] for d in app["deployments"]} <= names, names
    return app


def test_serve_vllm_yaml_is_a_valid_serve_config(tmp_path, tiny_decoder_dir, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path))
    config = _load("serve-vllm.yaml")
    app = _check_vllm_config(config, tmp_path, tiny_decoder_dir)
    assert config["http_options"]["host"] == "127.0.0.1"
    assert app["args"]["api_key_env"] == "HLM_API_KEY" and app["args"]["dtype"] == "auto"
    cluster = yaml.safe_load(_load("kuberay/rayservice-vllm.yaml")["spec"]["serveConfigV2"])
    [remote] = cluster["applications"]
    _check_vllm_config(cluster, tmp_path, tiny_decoder_dir)
    assert remote["args"]["num_gpus"] == 1 and remote["args"]["device"] == "cuda"
    assert remote["args"]["api_key_env"] == "HLM_API_KEY" and "api_key" not in remote["args"]
    assert remote["runtime_env"]["pip"]["packages"][0].startswith("hlm_ray[vllm] @ ")
    _check_runtime_env(remote["runtime_env"])
    spec = _load("kuberay/rayservice-vllm.yaml")["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            [env] = [e for e in container["env"] if e["name"] == "HLM_API_KEY"]
            assert env["valueFrom"]["secretKeyRef"]["name"] == "hlm-serve-api-key"


# ----------------------------------------------------------------------------- KubeRay


@pytest.mark.parametrize("rel", sorted(MANIFESTS))
def test_kuberay_manifest_validates_against_the_crd(rel):
    manifest = _load(rel)
    assert manifest["kind"] == MANIFESTS[rel] and manifest["apiVersion"] == "ray.io/v1"
    assert crd_errors(manifest) == []


def test_the_crd_check_catches_mistakes():
    manifest = _load("kuberay/raycluster.yaml")
    manifest["spec"]["workerGroupSpecs"][0]["rayStartParam"] = {}  # typo
    manifest["spec"]["workerGroupSpecs"][0]["replicas"] = "two"  # wrong type
    del manifest["spec"]["headGroupSpec"]["template"]  # required
    errors = "\n".join(crd_errors(manifest))
    assert "rayStartParam: unknown field" in errors
    assert "'two' is not of type 'integer'" in errors
    assert "'template' is a required property" in errors


@pytest.mark.parametrize("rel", sorted(MANIFESTS))
def test_manifests_use_this_ray_and_reach_mlflow(rel):
    import ray

    manifest = _load(rel)
    spec = manifest["spec"]
    cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    containers = _containers(manifest)
    for c in containers:
        assert c["image"].startswith(f"rayproject/ray:{ray.__version__}-py311")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env["MLFLOW_TRACKING_URI"] == TRACKING_URI
    gpu_workers = [
        g
        for g in cluster["workerGroupSpecs"]
        for c in g["template"]["spec"]["containers"]
        if c["resources"]["limits"].get("nvidia.com/gpu") == "1"
    ]
    assert gpu_workers and all(
        c["image"].endswith("-gpu")
        for g in gpu_workers
        for c in g["template"]["spec"]["containers"]
    )


def test_rayjob_runs_the_vocab_sweep_with_the_project_installed():
    import importlib.util

    found = importlib.util.spec_from_file_location("sweep_vocab", ROOT / "sweeps" / "vocab.py")
    script = importlib.util.module_from_spec(found)
    found.loader.exec_module(script)

    spec = _load("kuberay/rayjob-vocab-sweep.yaml")["spec"]
    scripts = re.findall(r"sweeps/\w+\.py", spec["entrypoint"])
    assert scripts == ["sweeps/vocab.py"]
    assert (ROOT / scripts[0]).is_file()
    preset = re.search(r"--preset (\w+)", spec["entrypoint"]).group(1)
    assert preset == "paper" and preset in script.PRESETS
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    _check_runtime_env(runtime_env)
    assert runtime_env["working_dir"].endswith(".zip")  # a remote URI, as a RayJob needs
    assert spec["shutdownAfterJobFinishes"] is True


def _check_runtime_env(runtime_env: dict) -> None:
    from ray.runtime_env import RuntimeEnv

    RuntimeEnv(**runtime_env)  # Ray's own validation
    [package] = runtime_env["pip"]["packages"]
    assert package.startswith(("hlm_ray @ ", "hlm_ray[vllm] @ "))
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] == TRACKING_URI


def test_rayservice_mirrors_serve_yaml():
    local = _load("serve.yaml")
    cluster = _serve_config_v2()
    app = _check_serve_config(cluster)
    [local_app] = local["applications"]
    assert app["import_path"] == local_app["import_path"]
    assert app["args"].keys() == local_app["args"].keys()
    assert app["args"]["model"] == local_app["args"]["model"]
    assert [d["name"] for d in app["deployments"]] == [d["name"] for d in local_app["deployments"]]
    for deployment in app["deployments"]:
        assert deployment["ray_actor_options"]["num_gpus"] == 1
        env = deployment["ray_actor_options"]["runtime_env"]["env_vars"]
        assert env == {"RAY_worker_niceness": "0"}
        assert deployment["max_ongoing_requests"] >= app["args"]["max_batch_size"]
    assert cluster["http_options"]["host"] == "0.0.0.0"
    _check_runtime_env(app["runtime_env"])


# ----------------------------------------------------------------------------- README


def test_readme_commands_and_references():
    text = (DEPLOY / "README.md").read_text()
    commands = re.sub(r"\s*\\\n\s*", " ", text)  # shell continuation lines joined
    for path in sorted(set(re.findall(r"\b(?:deploy|sweeps)/[\w./-]+\.(?:ya?ml|py|md)", text))):
        assert (ROOT / path).is_file(), f"README names {path}, which does not exist"
    for command in (
        "mlflow server --backend-store-uri postgresql+psycopg2://",  # SQLAlchemy 2.1: psycopg 3 else
        "--artifacts-destination s3://",
        "--host 0.0.0.0",
        "--allowed-hosts 'mlflow.mlflow.svc.cluster.local:5000",  # else every pod gets 403
        "RAY_AUTH_MODE=token ray job submit",
        "python sweeps/vocab.py --preset paper",
        "kubectl apply -f deploy/kuberay/rayservice.yaml",
        "serve run deploy/serve.yaml",
    ):
        assert command in commands, command
    assert TRACKING_URI in text


def test_the_api_key_comes_from_a_kubernetes_secret():
    """serve.yaml and the RayService read the key from HLM_API_KEY; every pod of the RayService
    takes it from the Secret, never from a literal."""
    [local] = _load("serve.yaml")["applications"]
    [cluster] = _serve_config_v2()["applications"]
    assert local["args"]["api_key_env"] == cluster["args"]["api_key_env"] == "HLM_API_KEY"
    assert "api_key" not in local["args"] and "api_key" not in cluster["args"]
    spec = _load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            [env] = [e for e in container["env"] if e["name"] == "HLM_API_KEY"]
            assert env["valueFrom"]["secretKeyRef"] == {
                "name": "hlm-serve-api-key",
                "key": "api-key",
            }


def test_readme_requests_send_the_key_the_server_reads():
    """serve.yaml's replicas read their key from HLM_API_KEY (401 without it once set): every
    curl and OpenAI client in the README sends a key from the environment."""
    text = (DEPLOY / "README.md").read_text()
    commands = re.sub(r"\s*\\\n\s*", " ", text)
    [local] = _load("serve.yaml")["applications"]
    env = local["args"]["api_key_env"]
    assert f"export {env}=" in commands
    curls = [line for line in commands.splitlines() if line.lstrip().startswith("curl ")]
    assert len(curls) >= 2
    for curl in curls:
        assert re.search(r'-H "Authorization: Bearer \$\w+"', curl), curl
    clients = re.findall(r"openai\.OpenAI\((.*)\)", text)
    assert clients and all(f'api_key=os.environ["{env}"]' in c for c in clients), clients
