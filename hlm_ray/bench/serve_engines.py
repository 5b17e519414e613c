"""The two serving engines side by side: the in-house engine (`hlm serve --engine hlm`) and vLLM
through Ray Serve LLM (`--engine vllm`), in one Ray, behind one Serve proxy, measured in
alternation.

    hlm bench --only serve-engines                         # both sizes -> runs/bench/serve-engines
    python -m hlm_ray.bench.serve_engines --sizes tiny --clients 1,8 --rounds 2

For each model size (`tiny`: the serving benchmark's tiny decoder, d = 64, 2 layers, V = 1,024;
`pythia-70m`: pythia-70m's shapes, d = 512, 6 layers, V = 50,304, random weights, the GPT-NeoX
tokenizer from the data folder) both engines serve the same folder in float32, each with one
CPU of a 2-CPU Ray, through Serve's proxy (the in-house engine with its decode process; direct
ingress is left out for both, since it would put the vLLM ingress past the proxy's guard).
A round sends `clients` concurrent streamed completions (greedy, `new_tokens` each, the same
prompts to both engines) and records, per engine: completion tokens/s over the round's wall
time, and each request's time to its first token. The engines alternate within each round and
swap their order from one round to the next (A B, B A, ...), so load that drifts over the run
falls on both. Printed: the median tokens/s, TTFT median and p99 over every request, the
ratio vLLM / in-house per row, and each engine's start-up (serve.run until the replica is
healthy: weights, engine, for vLLM its placement group and engine process). Results in
`--output` (serve_engines.json, serve_engines.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hlm_ray.bench.serve_clients import percentile
from hlm_ray.errors import HLMError, exit_status

SIZES = ("tiny", "pythia-70m")
ENGINES = ("hlm", "vllm")


def pythia_shaped(root: Path) -> str:
    """A decoder of pythia-70m's shapes with random weights (std 0.02) and the GPT-NeoX
    tokenizer, saved in float32 as a vanilla hlm decoder."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    from hlm_ray.paths import shared_file

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(shared_file("tokenizers/gpt-neox-20b/tokenizer.json")),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    config = GPTNeoXConfig(
        vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
        intermediate_size=2048, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    config.hlm_family, config.hlm_objective = "decoder", "vanilla"
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    folder = root / "pythia-70m-shaped" / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def make_model(size: str, root: Path) -> str:
    if size == "tiny":
        from hlm_ray.bench.serve import tiny_model

        return tiny_model(root / "tiny")
    if size == "pythia-70m":
        return pythia_shaped(root)
    raise HLMError(f"--sizes: {size!r} is not one of {', '.join(SIZES)}")


def start_engines(model: str, port: int) -> dict[str, Any]:
    """Both engines' applications behind one proxy on `port`: {engine: (url, start-up s)}."""
    from ray import serve

    from hlm_ray.serve.app import make_app
    from hlm_ray.serve.schemas import AppArgs
    from hlm_ray.serve.vllm.app import VllmArgs
    from hlm_ray.serve.vllm.app import make_app as make_vllm_app

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {
        "hlm": lambda: make_app(AppArgs(model=model, max_batch_size=32), num_cpus=1),
        "vllm": lambda: make_vllm_app(VllmArgs(model=model, num_cpus=1)),
    }
    out = {}
    for engine, build in apps.items():
        started = time.perf_counter()
        serve.run(build(), name=engine, route_prefix=f"/{engine}")
        out[engine] = (f"http://127.0.0.1:{port}/{engine}", time.perf_counter() - started)
    return out


async def _stream(session, url: str, body: dict) -> tuple[float, int]:
    """(seconds to the first token's chunk, completion tokens) of one streamed completion."""
    started, first, tokens = time.perf_counter(), None, 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise HLMError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices", ())):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first if first is not None else time.perf_counter() - started), tokens


async def _round(url: str, bodies: list[dict]) -> tuple[float, list[float]]:
    """(completion tokens/s, each request's TTFT) of `bodies` sent at once."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(_stream(session, url, b) for b in bodies))
        wall = time.perf_counter() - started
    return sum(t for _, t in results) / wall, [ttft for ttft, _ in results]


def measure(urls: dict[str, str], *, clients: list[int], rounds: int, new_tokens: int,
            log=print) -> list[dict[str, Any]]:  # fmt: skip
    """Rows {clients, engine, tokens_per_s (median over rounds), ttft_median_ms, ttft_p99_ms,
    requests}: the engines alternated within a round, their order swapped every round."""
    from hlm_ray.bench.serve import prompts

    rows = []
    for n in clients:
        bodies = [
            {"prompt": p, "max_tokens": new_tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}}
            for p in prompts(n)
        ]  # fmt: skip
        rates: dict[str, list[float]] = {e: [] for e in urls}
        ttfts: dict[str, list[float]] = {e: [] for e in urls}
        for engine in urls:  # warm-up: the first requests of a batch size are not timed
            asyncio.run(_round(urls[engine], bodies))
        for r in range(rounds):
            for engine in list(urls)[:: 1 if r % 2 == 0 else -1]:
                rate, ttft = asyncio.run(_round(urls[engine], bodies))
                rates[engine].append(rate)
                ttfts[engine].extend(ttft)
        for engine in urls:
            row = {"clients": n, "engine": engine,
                   "tokens_per_s": statistics.median(rates[engine]),
                   "ttft_median_ms": 1000 * statistics.median(ttfts[engine]),
                   "ttft_p99_ms": 1000 * percentile(ttfts[engine], 0.99),
                   "requests": len(ttfts[engine]), "rounds": rates[engine]}  # fmt: skip
            rows.append(row)
            log(f"  {n:>2} clients, {engine:>4}: {row['tokens_per_s']:8.0f} tokens/s, TTFT "
                f"median {row['ttft_median_ms']:.0f} ms, p99 {row['ttft_p99_ms']:.0f} ms")  # fmt: skip
    return rows


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | clients | in-house tokens/s | vLLM tokens/s | vLLM / in-house | TTFT median "
        "in-house / vLLM (ms) | TTFT p99 in-house / vLLM (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        by = {(r["clients"], r["engine"]): r for r in result["rows"]}
        for n in sorted({r["clients"] for r in result["rows"]}):
            h, v = by[n, "hlm"], by[n, "vllm"]
            lines.append(
                f"| {result['size']} | {n} | {h['tokens_per_s']:.0f} | {v['tokens_per_s']:.0f} | "
                f"{v['tokens_per_s'] / h['tokens_per_s']:.2f}x | {h['ttft_median_ms']:.0f} / "
                f"{v['ttft_median_ms']:.0f} | {h['ttft_p99_ms']:.0f} / {v['ttft_p99_ms']:.0f} |"
            )
    lines += ["", "| model | in-house start-up (s) | vLLM start-up (s) |", "|---|---|---|"]
    for result in results:
        s = result["startup_s"]
        lines.append(f"| {result['size']} | {s['hlm']:.0f} | {s['vllm']:.0f} |")
    return "\n".join(lines)


def run(sizes: list[str], *, clients: list[int], rounds: int, new_tokens: int,
        output: Path, log=print) -> list[dict[str, Any]]:  # fmt: skip
    import ray
    from ray import serve

    from hlm_ray.tracking.server import free_port

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            log(f"{size}: building the model")
            model = make_model(size, Path(tmp))
            ray.init(address="local", num_cpus=2, include_dashboard=True, log_to_driver=False)
            try:
                engines = start_engines(model, free_port())
                log(f"{size}: up (in-house {engines['hlm'][1]:.0f} s, vLLM "
                    f"{engines['vllm'][1]:.0f} s); measuring")  # fmt: skip
                rows = measure({e: u for e, (u, _) in engines.items()}, clients=clients,
                               rounds=rounds, new_tokens=new_tokens, log=log)  # fmt: skip
            finally:
                serve.shutdown()
                ray.shutdown()
            startup = {e: s for e, (_, s) in engines.items()}
            results.append({"size": size, "rows": rows, "startup_s": startup})
    output.mkdir(parents=True, exist_ok=True)
    (output / "serve_engines.json").write_text(json.dumps(results, indent=1))
    (output / "serve_engines.md").write_text(markdown(results) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hlm_ray.bench.serve_engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--sizes", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    p.add_argument("--clients", default="1,8,32", help="concurrent streamed clients per row")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and row")
    p.add_argument("--new-tokens", type=int, default=32, help="completion tokens per request")
    p.add_argument("--output", default="runs/bench/serve-engines")
    args = p.parse_args(argv)

    def go() -> int:
        from hlm_ray.serve.vllm.flags import INSTALL_HINT, vllm_installed

        if not vllm_installed():
            raise HLMError(f"the engines benchmark needs vLLM; {INSTALL_HINT}")
        clients = [int(c) for c in args.clients.split(",")]
        if args.rounds < 1 or args.new_tokens < 1 or min(clients) < 1:
            raise HLMError("--rounds, --new-tokens and every --clients value must be >= 1")
        results = run(args.sizes.split(","), clients=clients, rounds=args.rounds,
                      new_tokens=args.new_tokens, output=Path(args.output))  # fmt: skip
        print(markdown(results))
        print(f"wrote serve_engines.json and serve_engines.md to {args.output}")
        return 0

    return exit_status(go)


if __name__ == "__main__":
    import sys

    sys.exit(main())
