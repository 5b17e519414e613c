"""The folder vLLM loads for a decoder and its readout: the model's own files, with the readout
folded into vLLM's logit layer so that every logit vLLM computes is the readout's.

    served = served_folder(resolve_model_dir("runs/tiny-headless"), "prior")
    LLM(model=str(served), model_impl="transformers", dtype="float32")   # what the engine does

Why in the logit layer and not in a vLLM logits processor: vLLM applies logits processors to
the logits it samples from, but computes prompt log-probabilities (`echo` with `logprobs`, how
a client scores text through the endpoint, lm-eval's `local-completions` among them) straight
from the model's `compute_logits` (vllm/v1/worker/gpu_model_runner.py,
`_get_prompt_logprobs_dict`), past every processor. A readout there would give a sampled
token's log-probability and the same token's score as a prompt from two different models.

vLLM's Transformers modeling backend computes `logits = logit_scale · (h·Wᵀ + b)`, with
`logit_scale` read from config.json and `b` loaded from a weight named `lm_head.bias`. A readout
`scale · z + β · log q` (`hlm_ray.readout.Readout.apply`) is then exactly
`logit_scale = scale` and `b = β · log q / scale`, computed in float32 whatever the weights'
dtype. The folder holds symlinks to the model's files, a rewritten config.json, the bias in a
file of its own (`hlm_readout.safetensors`) and, for a tokenizer without one, the in-house
chat template (`hlm_ray.serve.protocol`) so that `/v1/chat/completions` lays messages out as
the in-house engine does. A readout that changes nothing (`head`) serves the folder as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.paths import cache_dir
from hlm_ray.readout import Readout, resolve_readout

BIAS_FILE = "hlm_readout.safetensors"
BIAS_WEIGHT = "lm_head.bias"  # the name vLLM's Transformers backend loads as the head's bias
INDEX_FILE = "model.safetensors.index.json"
# The in-house chat layout (hlm_ray.serve.protocol.chat_prompt) as a Jinja template: each
# message on its own line as `Role: text`, then `Assistant:` for the model to complete.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] in ['system', 'developer'] -%}System"
    "{%- elif m['role'] == 'user' -%}User{%- else -%}Assistant{%- endif -%}"
    ": {{ m['content'] if m['content'] is string else m['content'] | map(attribute='text') | join('') }}"
    "{{ '\\n' }}"
    "{%- endfor -%}Assistant:"
)


def needs_transformers_backend(readout: Readout) -> bool:
    """Whether the model must run on vLLM's Transformers backend (vLLM's own GPT-2 reads
    neither `logit_scale` nor a head bias; its GPT-NeoX is that backend already)."""
    return not readout.is_identity


def served_folder(
    folder: str | Path, readout_name: str | None = None, *, root: Path | None = None
) -> tuple[Path, Readout]:
    """(the folder vLLM loads for the decoder in `folder` with readout `readout_name` (None:
    the model's default), the readout). Written once under `root` (default
    `$HLM_CACHE_DIR/vllm`), keyed by the model's files and the readout's numbers."""
    folder = Path(folder).resolve()
    readout = resolve_readout(folder, readout_name)
    config = json.loads((folder / "config.json").read_text())
    template = None if _has_chat_template(folder) else CHAT_TEMPLATE
    if readout.is_identity and template is None:
        return folder, readout
    bias = readout.bias()
    key = _key(folder, readout, template)
    out = (root or cache_dir("vllm")) / f"{folder.parent.name}-{folder.name}-{key}"
    if (out / "config.json").is_file():
        return out, readout
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for entry in folder.iterdir():
        if entry.name not in ("config.json", INDEX_FILE, "tokenizer_config.json"):
            (tmp / entry.name).symlink_to(entry)
    if not readout.is_identity:
        config["logit_scale"] = readout.scale
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer_config(folder, tmp, template)
    if bias is not None:
        _write_bias(folder, tmp, bias / readout.scale)
    try:
        tmp.rename(out)
    except OSError:  # another process wrote the same folder first: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return out, readout


def _has_chat_template(folder: Path) -> bool:
    path = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file():
        return True
    return path.is_file() and bool(json.loads(path.read_text()).get("chat_template"))


def _write_tokenizer_config(folder: Path, out: Path, template: str | None) -> None:
    path = folder / "tokenizer_config.json"
    if template is None:
        if path.is_file():
            (out / path.name).symlink_to(path)
        return
    config = json.loads(path.read_text()) if path.is_file() else {}
    (out / path.name).write_text(json.dumps({**config, "chat_template": template}, indent=1))


def _write_bias(folder: Path, out: Path, bias_V) -> None:
    """The head's bias (V,) float32 in a file of its own; a sharded model's index names it."""
    from safetensors.torch import save_file

    save_file(
        {BIAS_WEIGHT: bias_V.float().contiguous()}, out / BIAS_FILE, metadata={"format": "pt"}
    )
    index = folder / INDEX_FILE
    if index.is_file():
        record = json.loads(index.read_text())
        record.setdefault("weight_map", {})[BIAS_WEIGHT] = BIAS_FILE
        (out / INDEX_FILE).write_text(json.dumps(record, indent=1))
    elif not any(folder.glob("*.safetensors")):
        raise HLMError(
            f"{folder} has no safetensors weights, which vLLM needs beside the readout's bias; "
            "save the model again with save_pretrained (safe_serialization=True)"
        )


def _key(folder: Path, readout: Readout, template: str | None) -> str:
    """A hash of what the served folder depends on: the model's files (name, size, time) and
    the readout's numbers."""
    digest = hashlib.sha256()
    for entry in sorted(folder.iterdir()):
        stat = entry.stat()
        digest.update(f"{entry.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    digest.update(f"{readout.name}:{readout.scale!r}:{readout.prior_weight!r};".encode())
    if readout.log_prior is not None:
        digest.update(readout.log_prior.tobytes())
    digest.update((template or "").encode())
    return digest.hexdigest()[:16]
