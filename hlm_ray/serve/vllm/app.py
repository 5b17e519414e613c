"""The vLLM engine's Serve application: Ray Serve LLM's OpenAI ingress and `LLMServer` over a
decoder folder, behind the same API key as the in-house engine's routes.

    serve run deploy/serve-vllm.yaml            # import_path: hlm_ray.serve.vllm.app:build_app
    hlm serve --engine vllm --model models:/hlm-tiny-generator/1

    from hlm_ray.serve.vllm.app import VllmArgs, make_app
    serve.run(make_app(VllmArgs(model="runs/tiny-gen")), name="hlm", route_prefix="/")

The application is the one `ray.serve.llm.build_openai_app` builds (an `OpenAiIngress`
deployment in front of one `LLMServer` deployment per model), put together here from the same
parts so that the ingress's FastAPI app gets three more middlewares
(`hlm_ray.serve.vllm.checks`): the API key on every route, as the in-house server checks it,
the request bodies vLLM's OpenAI layer would answer with a 500 refused with a 400, and every
error in OpenAI's shape. Bodies are read, bounded and timed by the
proxy's guard (`hlm_ray.serve.guard`) as for the in-house engine.

On a CPU node the ingress asks for no CPU (on 2 CPUs, the server's placement group held both
and the ingress never scheduled), the server's engine gets `num_cpus` CPUs in one bundle, and
vLLM's CPU KV cache gets `kv_cache_gib` (`VLLM_CPU_KVCACHE_SPACE`, which vLLM needs there).
"""

# No `from __future__ import annotations`: Serve reads `build_app`'s parameter annotation at run
# time to turn a config file's `args:` into `VllmArgs`.

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from hlm_ray.errors import HLMError
from hlm_ray.generate import check_generation_ready, default_model_name
from hlm_ray.pretrained import model_info, resolve_model_dir
from hlm_ray.serve.vllm.checks import BodyCheck, ErrorShape, KeyCheck

SERVER_CLS = "hlm_ray.serve.vllm.server:HLMLLMServer"
MODEL_ENV = "HLM_VLLM_MODEL"  # the replica re-resolves the model on its own node from these
READOUT_ENV = "HLM_VLLM_READOUT"
DTYPES = ("auto", "float32", "bfloat16", "float16")


class VllmArgs(BaseModel):
    """Arguments of `hlm_ray.serve.vllm.app:build_app` (the `args:` of a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """A run, checkpoint or model folder, or `models:/NAME/VERSION` / `models:/NAME@alias`."""
    name: str | None = None
    """The id the model is served under (default: NAME/VERSION or the run folder's name)."""
    readout: Literal["head", "tied", "prior"] | None = None
    """How hidden states become logits (`hlm_ray.readout`); None: the model's own (a headless
    decoder never fine-tuned: its prior readout)."""
    allow_raw_head: bool = False
    """Serve a raw headless decoder through its tied Eᵀ when it has no token counts."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype in vLLM; "auto": the dtype the model was saved in (vLLM's own "auto"
    casts float32 to bfloat16, and the endpoint's greedy text would then differ from
    `hlm generate`'s)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": a GPU when `num_gpus` asks for one."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs of the engine's placement-group bundle."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per replica (vLLM takes whole ones: 0 or 1 here; more is tensor parallelism,
    set it through `engine_kwargs`)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence (prompt + completion); default: the model's positions."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """On a CPU: vLLM's KV cache, GiB per replica."""
    enforce_eager: bool | None = None
    """True: no compiled graphs (start-up in seconds rather than minutes on a CPU); None:
    eager on a CPU, graphs on a GPU."""
    api_key: SecretStr | None = None
    """Clients must send `Authorization: Bearer KEY` on every route (401 otherwise). Prefer
    `api_key_env`: a key given here is part of the application's config."""
    api_key_env: str = "HLM_API_KEY"
    """Environment variable of the ingress replica holding the key when `api_key` is not set
    (in Kubernetes, from a Secret); unset or empty and no `api_key`: no key."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More of vLLM's engine arguments, passed as they are (last: they win)."""


def check_model(args: VllmArgs) -> tuple[Path, str]:
    """(the model folder, its readout) or one line saying why it cannot be served: a
    registry URI that does not resolve, an encoder, a raw headless decoder without a readout."""
    folder = resolve_model_dir(args.model)
    readout = check_generation_ready(
        model_info(folder),
        args.model,
        allow_raw_head=args.allow_raw_head,
        readout=args.readout,
        folder=folder,
    )
    return folder, readout or "head"


def saved_dtype(folder: Path) -> str:
    """The dtype config.json records (transformers 5 writes `dtype`, 4 `torch_dtype`)."""
    config = json.loads((folder / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES[1:]:
        raise HLMError(f"{folder} was saved in {dtype}, which vLLM does not serve; pass --dtype")
    return dtype


def max_positions(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(config.get(key), int):
            return config[key]
    raise HLMError(f"cannot tell how many positions {folder} allows; pass --max-model-len")


def llm_config(args: VllmArgs, deployment: dict[str, Any] | None = None, niceness: int | None = 0):
    """Ray Serve LLM's `LLMConfig` for `args`: the served folder (`served_folder`, the readout
    in the logit layer), the saved dtype, CPU or GPU resources; `deployment`: Serve options of
    the server deployment (replicas, queue limits, health checks)."""
    from ray.serve.llm import LLMConfig

    from hlm_ray.serve.vllm.folder import needs_transformers_backend, served_folder

    folder, readout_name = check_model(args)
    served, readout = served_folder(folder, readout_name)
    gpu = args.device == "cuda" or (args.device == "auto" and args.num_gpus > 0)
    if args.device == "cuda" and args.num_gpus == 0:
        raise HLMError("--device cuda needs --num-gpus 1 (vLLM takes a whole GPU per replica)")
    positions = max_positions(folder)
    if args.max_model_len is not None and args.max_model_len > positions:
        raise HLMError(
            f"--max-model-len={args.max_model_len} is above the model's {positions} positions"
        )
    engine: dict[str, Any] = {
        "dtype": saved_dtype(folder) if args.dtype == "auto" else args.dtype,
        "max_model_len": args.max_model_len or positions,
        "enforce_eager": (not gpu) if args.enforce_eager is None else args.enforce_eager,
    }
    if needs_transformers_backend(readout):  # the readout lives in its logit layer
        engine["model_impl"] = "transformers"
    engine.update(args.engine_kwargs)
    env = {MODEL_ENV: args.model, READOUT_ENV: readout_name}
    if niceness is not None:  # the replica and its engine process (Ray's workers: 15)
        env["RAY_worker_niceness"] = str(niceness)
    deployment = dict(deployment or {})
    if gpu:
        hardware: dict[str, Any] = {"accelerator_config": {"kind": "gpu"}}
    else:
        # The replica's own CPU would be added to the engine's bundle (Ray Serve LLM merges
        # them): 2 CPUs for `num_cpus=1`, which a 2-CPU node running anything else never has.
        # The engine runs in the replica's process tree: the bundle is what they share.
        deployment.setdefault("ray_actor_options", {}).setdefault("num_cpus", 0)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
        hardware = {
            "accelerator_config": {"kind": "cpu"},
            "placement_group_config": {"bundles": [{"CPU": args.num_cpus}]},
        }
    return LLMConfig(
        model_loading_config={"model_id": model_name(args), "model_source": str(served)},
        engine_kwargs=engine,
        runtime_env={"env_vars": env},
        deployment_config=deployment,
        server_cls=SERVER_CLS,
        **hardware,
    )


def model_name(args: VllmArgs) -> str:
    return args.name or default_model_name(args.model)


def build_app(args: VllmArgs):
    """The application a Serve config file names (`import_path:
    hlm_ray.serve.vllm.app:build_app`); deployment options of the server come from
    `engine_kwargs`-free fields here and the file's `deployments:` section."""
    if not isinstance(args, VllmArgs):
        args = VllmArgs.model_validate(args)
    return make_app(args)


def make_app(
    args: VllmArgs,
    *,
    num_replicas: int | None = None,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int | None = None,
    health_check_period_s: float | None = None,
    niceness: int | None = 0,
):
    """The OpenAI application over one `LLMServer` deployment: `build_openai_app`'s parts, with
    the key on every route of the ingress."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import (
        OpenAiIngress,
        init,
        make_fastapi_ingress,
    )
    from ray.serve.llm import build_llm_deployment

    deployment = {
        "num_replicas": num_replicas,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "health_check_period_s": health_check_period_s,
    }
    deployment = {k: v for k, v in deployment.items() if v is not None}
    config = llm_config(args, deployment, niceness)
    app = init()
    key = args.api_key.get_secret_value() if args.api_key else None
    app.add_middleware(ErrorShape)  # FastAPI's {"detail": ...} errors in OpenAI's shape
    app.add_middleware(BodyCheck)  # what vLLM would answer with a 500
    app.add_middleware(KeyCheck, env=args.api_key_env, key=key)  # last added: runs first
    ingress = make_fastapi_ingress(OpenAiIngress, app=app)
    options = OpenAiIngress.get_deployment_options([config])
    options["ray_actor_options"] = {
        "num_cpus": 0,  # beside the engine's bundle, which may hold the node's every CPU
        "runtime_env": {"env_vars": {"RAY_worker_niceness": str(niceness or 0)}},
    }
    if max_queued_requests is not None:
        options["max_queued_requests"] = max_queued_requests
    return serve.deployment(ingress, name="OpenAiIngress", **options).bind(
        llm_deployments={config.model_id: build_llm_deployment(config)},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)},
        lora_paths={},
    )
