"""The Serve application of the completions server: what a config file or `hlm serve` builds.

    serve run deploy/serve.yaml                  # import_path: hlm_ray.serve.app:build_app
    hlm serve --model models:/hlm-tiny-generator/1

    from hlm_ray.serve.app import make_app
    serve.run(make_app(AppArgs(model="runs/tiny-gen"), num_replicas=2, max_queued_requests=64))

`build_app` and `make_app` check the model first (it resolves, it can generate), so a wrong
`models:/` URI or a headless decoder that was never fine-tuned fails before any replica starts.
The deployment itself is `hlm_ray.serve.server.CompletionServer`.
"""

# No `from __future__ import annotations` in this module: Serve reads `build_app`'s parameter
# annotation at run time to turn a config file's `args:` into `AppArgs`, which a string defeats.

from typing import Any

from ray.serve import Application

from hlm_ray.generate import check_generation_ready, default_model_name
from hlm_ray.pretrained import model_info, resolve_model_dir
from hlm_ray.serve.schemas import AppArgs
from hlm_ray.serve.server import CompletionServer

__all__ = ["AppArgs", "CompletionServer", "build_app", "check_model", "make_app", "model_name"]


def check_model(args: AppArgs) -> None:
    """Fail fast, with the reason, when the model does not resolve or cannot generate (before
    any replica starts: a `models:/` URI that does not exist, an encoder, a headless decoder)."""
    folder = resolve_model_dir(args.model)
    check_generation_ready(
        model_info(folder),
        args.model,
        allow_raw_head=args.allow_raw_head,
        readout=args.readout,
        folder=folder,
    )


def build_app(args: AppArgs) -> Application:
    """The application a Serve config file names (`import_path: hlm_ray.serve.app:build_app`);
    Serve validates the file's `args:` into `AppArgs`. Deployment options (replicas,
    autoscaling, resources, queue limits) come from the file's `deployments:` section."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    check_model(args)
    return CompletionServer.bind(args)


def make_app(
    args: AppArgs,
    *,
    num_replicas: int | str | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int | None = None,
    name: str | None = None,
    niceness: int | None = None,
) -> Application:
    """`build_app` with deployment options given in code (what `hlm serve` and tests use);
    None keeps the deployment's default. `niceness`: the replicas' (and their decode
    processes') scheduling niceness, 0 by default; 15 is Ray's default for its workers."""
    check_model(args)
    actor = dict(CompletionServer.ray_actor_options or {})
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    if num_gpus is not None:
        actor["num_gpus"] = num_gpus
    if niceness is not None:
        env = {**actor["runtime_env"]["env_vars"], "RAY_worker_niceness": str(niceness)}
        actor["runtime_env"] = {**actor["runtime_env"], "env_vars": env}
    options: dict[str, Any] = {
        "num_replicas": num_replicas,
        "autoscaling_config": autoscaling_config,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "name": name,
    }
    options = {k: v for k, v in options.items() if v is not None}
    return CompletionServer.options(ray_actor_options=actor, **options).bind(args)


def model_name(args: AppArgs) -> str:
    """The id the app serves its model under."""
    return args.name or default_model_name(args.model)
