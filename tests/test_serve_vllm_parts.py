"""The vLLM engine's parts as plain functions, without Ray or vLLM running: the served folder
(the readout folded into the logit layer, checked against `Readout.apply` on random inputs),
the ingress's key and body checks (ASGI), `hlm serve`'s engine flags and the LLM config."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_common import headless_copy

from hlm_ray.errors import HLMError
from hlm_ray.serve.vllm.checks import BodyCheck, KeyCheck, problem
from hlm_ray.serve.vllm.folder import BIAS_FILE, BIAS_WEIGHT, CHAT_TEMPLATE, served_folder


@pytest.fixture(scope="module")
def headless_dir(tiny_decoder_dir, tmp_path_factory) -> Path:
    folder = headless_copy(
        tiny_decoder_dir, tmp_path_factory.mktemp("parts") / "headless" / "model"
    )
    record = json.loads((folder / "readout.json").read_text())
    record["temperature"] = 0.25  # τ: the readout's scale is s / τ = 4 s
    record["prior"] = {"scale": 1.5, "prior_weight": 0.75, "method": "fitted"}
    (folder / "readout.json").write_text(json.dumps(record))
    return folder


def vllm_logits(folder: Path, h_ND: torch.Tensor, head_VD: torch.Tensor) -> torch.Tensor:
    """What vLLM's Transformers backend computes from the served folder: logit_scale · (h·Wᵀ
    + b) (vllm/model_executor/models/transformers/causal.py, compute_logits)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    bias = load_file(folder / BIAS_FILE)[BIAS_WEIGHT] if (folder / BIAS_FILE).exists() else 0
    return config.get("logit_scale", 1.0) * (h_ND @ head_VD.T + bias)


@pytest.mark.parametrize("readout", ["prior", "tied"])
def test_the_served_folder_computes_the_readouts_logits(headless_dir, tmp_path, readout):
    from hlm_ray.readout import resolve_readout

    served, got = served_folder(headless_dir, readout, root=tmp_path)
    want = resolve_readout(headless_dir, readout)
    assert (got.name, got.scale, got.prior_weight) == (want.name, want.scale, want.prior_weight)
    assert want.scale == pytest.approx((1.5 if readout == "prior" else 1.0) / 0.25)
    g = torch.Generator().manual_seed(0)
    vocab, dim = want.log_prior.shape[0] if want.log_prior is not None else 1024, 64
    for scale in (1.0, 30.0):  # ordinary and extreme hidden states
        h_ND = torch.randn(5, dim, generator=g) * scale
        head_VD = torch.randn(vocab, dim, generator=g)
        expected = want.apply(h_ND @ head_VD.T)
        torch.testing.assert_close(
            vllm_logits(served, h_ND, head_VD), expected, rtol=1e-5, atol=1e-4
        )
    assert (served / "config.json").is_file() and served != Path(headless_dir)
    # Every other file is the model's own, linked, not copied.
    assert (served / "model.safetensors").resolve() == (headless_dir / "model.safetensors")
    tokenizer = json.loads((served / "tokenizer_config.json").read_text())
    assert tokenizer["chat_template"] == CHAT_TEMPLATE


def test_the_served_folder_is_written_once_and_follows_the_readout(headless_dir, tmp_path):
    first, _ = served_folder(headless_dir, "prior", root=tmp_path)
    again, _ = served_folder(headless_dir, "prior", root=tmp_path)
    assert first == again and len(list(tmp_path.iterdir())) == 1
    record = json.loads((headless_dir / "readout.json").read_text())
    changed = tmp_path / "changed"
    shutil.copytree(headless_dir, changed / "model", symlinks=True)
    record["prior"]["prior_weight"] = 0.5
    (changed / "model" / "readout.json").write_text(json.dumps(record))
    other, readout = served_folder(changed / "model", "prior", root=tmp_path)
    assert other != first and readout.prior_weight == 0.5


def test_a_head_readout_with_a_chat_template_serves_the_folder_as_it_is(tiny_decoder_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_decoder_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "x"}))
    served, readout = served_folder(folder, None, root=tmp_path / "cache")
    assert served == folder.resolve() and readout.name == "head"


def test_the_chat_template_lays_messages_out_as_the_in_house_engine(headless_dir, tmp_path):
    from transformers import AutoTokenizer

    from hlm_ray.serve.protocol import chat_prompt
    from hlm_ray.serve.schemas import ChatMessage

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Really."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "a cat?"}],
        },
        {"role": "assistant", "content": "An animal."},
        {"role": "user", "content": "And a dog?"},
    ]
    want = chat_prompt([ChatMessage.model_validate(m) for m in messages])
    tokenizer = AutoTokenizer.from_pretrained(served_folder(headless_dir, root=tmp_path)[0])
    assert tokenizer.apply_chat_template(messages, tokenize=False) == want


# ----------------------------------------------------------------------------- ASGI checks


def call(app, path="/v1/completions", method="POST", body=b"{}", headers=()):
    """Run an ASGI app once; (status, JSON body or None, what the inner app received)."""
    sent, seen = [], {}

    async def inner(scope, receive, send):
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": method, "headers": list(headers)}
    asyncio.run(app(inner)(scope, receive, send))
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(payload), seen.get("body")


def test_every_route_needs_the_key_the_argument_or_the_environment_gives(monkeypatch):
    keyed = lambda app: KeyCheck(app, env="HLM_TEST_VLLM_KEY", key="k-123")  # noqa: E731
    for path in ("/v1/completions", "/v1/models", "/docs", "/anything"):
        status, body, reached = call(keyed, path)
        assert (status, body["error"]["code"], reached) == (401, "invalid_api_key", None)
    for value in (b"Bearer k-12", b"Bearer k-1234", b"k-123", b"Basic k-123", b"Bearer "):
        assert call(keyed, headers=[(b"authorization", value)])[0] == 401
    assert call(keyed, headers=[(b"authorization", b"bearer  k-123 ")])[0] == 200
    monkeypatch.setenv("HLM_TEST_VLLM_KEY", "from-env")
    from_env = lambda app: KeyCheck(app, env="HLM_TEST_VLLM_KEY")  # noqa: E731
    assert call(from_env)[0] == 401
    assert call(from_env, headers=[(b"authorization", b"Bearer from-env")])[0] == 200
    monkeypatch.delenv("HLM_TEST_VLLM_KEY")
    assert call(from_env)[0] == 200  # no key anywhere: open, as documented


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"prompt": "\\ud800"}', "body.prompt: a string with a lone UTF-16 surrogate"),
        (b'{"messages": [{"content": "a\\udc0d"}]}', "body.messages[0].content"),
        (b'{"prompt": "x", "max_tokens": 1e999}', "1e999 is not a finite number"),
        (b'{"prompt": "x", "temperature": NaN}', "NaN is not a number"),
        (b'{"prompt": "x", "top_p": -Infinity}', "-Infinity is not a number"),
        (b'{"prompt": "x", "top_k": 100000000000000000000}', "body.top_k"),
        (b'{"prompt": "x", "seed": -9223372036854775809}', "past the 64-bit"),
        (b'{"\\ud800": 1}', "body key"),
        (b"not json", "request body is not valid JSON"),
        (b"\xff\xfe", "request body is not valid JSON"),
        (b"", "request body is not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    ],
)
def test_bodies_vllm_would_answer_500_are_400_naming_what(body, named):
    status, answer, reached = call(BodyCheck, body=body)
    assert status == 400 and reached is None
    assert named in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x", "seed": 9223372036854775807, "top_p": 1e-300}',
        b'{"prompt": "\\ud83d\\udc0d"}',
        b'[1, {"a": [null, true, -2.5]}]',
    ],
)
def test_other_bodies_reach_vllm_unchanged(body):
    assert problem(body) is None
    assert call(BodyCheck, body=body) == (200, {}, body)


def test_gets_and_other_content_types_pass_the_body_check_untouched():
    assert call(BodyCheck, method="GET", body=b'{"x": NaN}')[0] == 200
    form = [(b"content-type", b"multipart/form-data; boundary=x")]
    assert call(BodyCheck, body=b"--x\r\n", headers=form) == (200, {}, b"--x\r\n")


# ----------------------------------------------------------------------------- flags, config


def serve_args(*argv: str) -> argparse.Namespace:
    from hlm_ray.serve.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "vllm", "--max-batch-size", "4"], "--max-batch-size: the in-house engine's"),
        (["--engine", "vllm", "--no-decode-process"], "--decode-process: the in-house"),
        (["--engine", "vllm", "--direct-ingress"], "--direct-ingress: the in-house"),
        (["--engine", "hlm", "--dtype", "bfloat16"], "--dtype: the vLLM engine's"),
        (["--engine", "hlm", "--max-model-len", "64"], "--max-model-len: the vLLM"),
        (["--engine", "vllm", "--kv-cache-gib", "0"], "--kv-cache-gib=0 must be"),
        (["--engine", "vllm", "--max-model-len", "0"], "--max-model-len=0 must be"),
    ],
)
def test_a_flag_of_the_other_engine_is_refused_naming_it(argv, message):
    from hlm_ray.serve.vllm.flags import chosen_engine

    with pytest.raises(HLMError, match=message.replace("-", r"\-")):
        chosen_engine(serve_args(*argv))


def test_vllm_asked_for_where_it_is_not_installed_says_how_to_install(monkeypatch):
    from hlm_ray.serve.vllm import flags

    monkeypatch.setattr(flags, "vllm_installed", lambda: False)
    with pytest.raises(HLMError, match="make setup-vllm"):
        flags.chosen_engine(serve_args("--engine", "vllm"))
    assert flags.chosen_engine(serve_args()) == "hlm"  # auto without vLLM


def test_auto_takes_vllm_on_a_gpu_and_the_measured_one_on_a_cpu(monkeypatch, tiny_decoder_dir):
    from hlm_ray.serve.vllm import flags

    monkeypatch.setattr(flags, "vllm_installed", lambda: True)
    assert flags.chosen_engine(serve_args("--num-gpus", "1")) == "vllm"
    params = flags.parameters(tiny_decoder_dir)
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_decoder_dir))
    assert params == sum(p.numel() for p in model.state_dict().values() if p.is_floating_point())
    args = argparse.Namespace(num_gpus=0, model=tiny_decoder_dir)
    for threshold, engine in ((None, "hlm"), (params, "vllm"), (params + 1, "hlm")):
        monkeypatch.setattr(flags, "VLLM_FASTER_ON_CPU_FROM", threshold)
        assert flags.default_engine(args) == engine


def test_the_llm_config_serves_the_saved_dtype_on_cpus(headless_dir, monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from hlm_ray.serve.vllm.app import VllmArgs, llm_config

    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path))
    config = llm_config(VllmArgs(model=str(headless_dir), num_cpus=0.5), {"num_replicas": 2})
    engine = config.engine_kwargs
    assert engine["dtype"] == "float32" and engine["model_impl"] == "transformers"
    assert engine["enforce_eager"] is True and engine["max_model_len"] == 128
    assert config.accelerator_config.kind == "cpu"
    assert config.placement_group_config == {"bundles": [{"CPU": 0.5}]}
    assert config.deployment_config["num_replicas"] == 2
    # The replica counts no CPU of its own: the placement group is the engine's bundle alone.
    from ray.serve.llm import LLMServer

    options = LLMServer.get_deployment_options(config)
    assert options["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 0}]
    env = config.runtime_env["env_vars"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["RAY_worker_niceness"] == "0"
    assert Path(config.model_loading_config.model_source).parent == tmp_path / "vllm"
    bf16 = llm_config(VllmArgs(model=str(headless_dir), dtype="bfloat16", readout="prior"))
    assert bf16.engine_kwargs["dtype"] == "bfloat16"
    with pytest.raises(HLMError, match="above the model's 128 positions"):
        llm_config(VllmArgs(model=str(headless_dir), max_model_len=129))


def test_a_replica_on_another_node_serves_the_same_folder(headless_dir, monkeypatch, tmp_path):
    from hlm_ray.serve.vllm.server import local_source

    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "here"))
    here, _ = served_folder(headless_dir, "prior")
    assert local_source(str(here)) == str(here)
    env = {"HLM_VLLM_MODEL": str(headless_dir), "HLM_VLLM_READOUT": "prior"}
    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "there"))  # another node's cache
    there = Path(local_source(str(tmp_path / "not-on-this-node"), env))
    assert there.parent == tmp_path / "there" / "vllm" and there.name == here.name
    assert np.array_equal(
        json.loads((there / "config.json").read_text())["logit_scale"],
        json.loads((here / "config.json").read_text())["logit_scale"],
    )


def test_fastapis_errors_are_rewritten_in_openais_shape_and_openai_shaped_ones_pass():
    from hlm_ray.serve.vllm.checks import ErrorShape

    def app_answering(status: int, body: bytes):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": body[:5], "more_body": True})
            await send({"type": "http.response.body", "body": body[5:]})

        return lambda _inner: ErrorShape(app)

    detail = b'{"detail": "Could not find base model with ID \\"gpt-4\\"."}'
    status, body, _ = call(app_answering(404, detail))
    assert (
        status == 404 and body["error"]["message"] == 'Could not find base model with ID "gpt-4".'
    )
    assert set(body["error"]) == {"message", "type", "param", "code"}
    shaped = b'{"error": {"message": "m", "type": "t", "param": null, "code": 1}}'
    assert call(app_answering(400, shaped))[:2] == (400, json.loads(shaped))
    status, body, _ = call(app_answering(500, b"Internal Server Error"))
    assert (status, body["error"]["message"]) == (500, "Internal Server Error")
    assert call(app_answering(200, b'{"ok": 1}'))[:2] == (200, {"ok": 1})


def test_hlm_serve_engine_vllm_checks_first_and_builds_the_app_once_ray_runs(
    headless_dir, monkeypatch, capsys
):
    """`hlm serve --engine vllm` (the command's path without Ray): the flags and the model are
    checked before anything starts, the application is handed to `launch.start` as a function
    (Ray Serve LLM's builder reads Ray's context, which would start a Ray of Ray's defaults),
    through the proxy (no direct ingress), with the guard's limits; Ctrl-C shuts down."""
    from hlm_ray.serve import cli, launch
    from hlm_ray.serve.vllm import flags

    monkeypatch.setattr(flags, "vllm_installed", lambda: True)
    calls = []

    def fake_start(app, ports, *, guard, ray, keep_alive_s):
        calls.append({"app": app, "ports": ports, "guard": guard, "ray": ray})
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "start", fake_start)
    args = serve_args("--engine", "vllm", "--body-timeout-s", "3", "--port", "8719")
    args.model = str(headless_dir)
    import signal

    # The command installs its Ctrl-C and SIGTERM handlers: the next tests get theirs back.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.run(args) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    [seen] = calls
    assert callable(seen["app"]) and not seen["ports"].direct and seen["ports"].port == 8719
    assert seen["guard"]["body_timeout_s"] == 3 and seen["ray"] == {"address": None}
    assert "shutting down" in capsys.readouterr().out
    args.model = str(headless_dir.parent / "nothing-here")
    with pytest.raises(HLMError, match="does not exist"):
        cli.run(args)
    assert len(calls) == 1  # the bad model never reached start
