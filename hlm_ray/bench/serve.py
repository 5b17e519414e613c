"""The serving benchmarks: what HTTP + Ray Serve cost over in-process generation, and a soak.

    hlm bench --only serve                                   # both, on a fresh tiny decoder
    python -m hlm_ray.bench.serve --model runs/tiny-gen --rounds 15 --soak 10000
    python -m hlm_ray.bench.serve --soak 0                   # the overhead ratio only

Overhead: the same decoder and prompts (32 prompts x 32 new tokens, temperature 1) decoded by
`Generator.generate` in this process (one batch) and served to 32 concurrent HTTP clients (one
prompt each, `max_batch_size` 32); arms alternate (in, served, served, in, ...) in one run and
each arm's figure is its median round, in completion tokens per second. The in-process arm
uses the replica's torch thread count. Target: served / in-process >= 0.8. Each served round
also reads the replica's counters (`GET /healthz`) for where its time went (`breakdown`):
prefills, steps and rows per step of the continuous batch, the decode thread's busy time and
ms per step (against the in-process arm's), the lead from the first request sent to the first
prefill (HTTP, proxy, routing, parsing), the tail from the last step to the last answer, and
the CPU time the clients, the proxy and the replica used (`/proc/PID/stat`).

Soak: `--soak` requests (small completions, `--concurrency` clients) against the same server:
throughput, p50/p95/p99 latency, every status code, and the resident memory (RSS) of the
replica and the proxy before and after. Loopback only; a Ray instance started here is shut
down. Results: printed as Markdown and written to `--output` (serve.json, serve.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

CONFIGS = {
    "fast": "hlm serve --direct-port P --decode-process: the replica answers HTTP itself and "
    "decodes in a process of its own",
    "proxy": "hlm serve: through Ray Serve's proxy, decoding on the replica's thread",
}
PROMPT_WORDS = ["cat", "house", "river", "Paris", "green", "music", "stone", "winter"]


def tiny_model(root: Path) -> str:
    """A tiny vanilla decoder (trained 2 steps, then random weights of std 0.15 so that its
    text varies): the model of the issue's figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from hlm_ray.presets import load_config
    from hlm_ray.train.loop import train_worker

    os.environ.setdefault("HLM_CACHE_DIR", str(root / "cache"))
    cfg = load_config(
        "tiny-decoder",
        objective="vanilla",
        overrides={"optim.max_steps": 2, "run.output_dir": str(root / "run")},
    )
    model_dir = train_worker(cfg.to_dict(), progress=False)["model_dir"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(model_dir)
    return model_dir


def prompts(num: int) -> list[str]:
    return [
        f"The {PROMPT_WORDS[i % len(PROMPT_WORDS)]} number {i} is a word that" for i in range(num)
    ]


# ----------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model: str,
    *,
    num_cpus: float,
    max_batch_size: int,
    app: str,
    max_tokens: int = 64,
    fast: bool = False,
) -> str:
    """Serve `model` on a free loopback port (the guard included); returns its URL. `fast`:
    the throughput configuration of `hlm serve --direct-port P --decode-process` (see
    `hlm_ray.serve.cli`): decoding in a process of its own, a 20 ms wait for a first batch
    (as deploy/serve.yaml), and, when Ray starts here, the replica answering HTTP itself."""
    import ray
    from ray import serve

    from hlm_ray.serve.app import make_app
    from hlm_ray.serve.cli import direct_ingress_env
    from hlm_ray.serve.guard import guard_controller_options
    from hlm_ray.serve.schemas import AppArgs

    direct = None
    if not ray.is_initialized():
        if fast:  # read by Serve's controller and replicas as they start
            direct = _free_port()
            os.environ.update(direct_ingress_env(direct, replicas=1))
        ray.init(address="local", num_cpus=2, log_to_driver=False, include_dashboard=False)
    port = _free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        controller_options=guard_controller_options(),
    )
    args = AppArgs(
        model=model,
        max_batch_size=max_batch_size,
        max_tokens_limit=max(64, max_tokens),
        decode_process=fast,
        batch_wait_timeout_s=0.02 if fast else 0.0,
    )
    serve.run(make_app(args, num_cpus=num_cpus), name=app, route_prefix="/")
    return f"http://127.0.0.1:{direct or port}"


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def serve_pids(app: str) -> dict[str, int | None]:
    """The replica of `app` and the proxy beside it (same raylet), found by process title."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            procs[int(entry.name)] = (cmd, ppid)
    replica = next((p for p, (c, _) in procs.items() if f"ServeReplica:{app}:" in c), None)
    parent = procs[replica][1] if replica else None
    proxy = next(
        (p for p, (c, pp) in procs.items() if "ProxyActor" in c and pp == parent and parent),
        None,
    )
    decode = next(
        (p for p, (c, pp) in procs.items() if "spawn_main" in c and pp == replica and replica),
        None,
    )
    return {"replica": replica, "proxy": proxy, **({"decode": decode} if decode else {})}


# ----------------------------------------------------------------------------- the clients


def _session(concurrency: int):
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


async def _post_all(
    session, url: str, bodies: list[dict], concurrency: int
) -> list[tuple[int, float, int]]:
    """POST every body with `concurrency` clients: (status, latency s, tokens)."""
    queue = list(reversed(bodies))
    out: list[tuple[int, float, int]] = []

    async def client() -> None:
        while queue:
            body = queue.pop()
            start = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as r:
                data = await r.read()
                tokens = json.loads(data)["usage"]["completion_tokens"] if r.status == 200 else 0
                out.append((r.status, time.perf_counter() - start, tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


async def _requests(url: str, bodies: list[dict], concurrency: int) -> list[tuple[int, float, int]]:
    async with _session(concurrency) as session:
        return await _post_all(session, url, bodies, concurrency)


def send(url: str, bodies: list[dict], concurrency: int) -> list[tuple[int, float, int]]:
    """`bodies` from `concurrency` new keep-alive clients (the soak)."""
    return asyncio.run(_requests(url, bodies, concurrency))


class Clients:
    """`concurrency` keep-alive clients kept across rounds, on an event loop of their own (as
    OpenAI's client keeps its connections): a round pays for no connection set-up."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.url, self.concurrency = url, concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._session = self._call(self._open())

    async def _open(self):
        return _session(self.concurrency)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def send(self, bodies: list[dict]) -> list[tuple[int, float, int]]:
        return self._call(_post_all(self._session, self.url, bodies, self.concurrency))

    def close(self) -> None:
        self._call(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ----------------------------------------------------------------------------- benchmarks


def overhead(url: str, model: str, *, rounds: int, num_prompts: int, new_tokens: int,
             threads: int, pids: dict[str, int | None] | None = None,
             log=print) -> dict[str, Any]:  # fmt: skip
    """Served vs in-process tokens/s, arms alternated; medians and the ratio. `pids` (the
    replica's and the proxy's, `serve_pids`) adds each process's CPU time per round."""
    import torch

    from hlm_ray.generate import Generator

    torch.set_num_threads(threads)
    gen = Generator.load(model, device="cpu")
    texts = prompts(num_prompts)
    arms: dict[str, list[float]] = {"in_process": [], "served": []}
    breakdowns: list[dict[str, float]] = []

    cpu_in: list[float] = []

    def in_process(seed: int) -> float:
        start, cpu = time.perf_counter(), time.thread_time()
        out = gen.generate(texts, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
        cpu_in.append(time.thread_time() - cpu)
        return sum(c.completion_tokens for c in out) / (time.perf_counter() - start)

    def served(seed: int) -> float:
        bodies = [{"prompt": p, "max_tokens": new_tokens, "temperature": 1.0, "seed": seed}
                  for p in texts]  # fmt: skip
        before, cpu = health(url), cpu_seconds(pids or {})
        start, unix_start, client = time.perf_counter(), time.time(), time.process_time()
        answers = clients.send(bodies)
        wall = time.perf_counter() - start
        client = time.process_time() - client
        cpu = {k: v - cpu[k] for k, v in cpu_seconds(pids or {}).items()}
        assert all(s == 200 for s, _, _ in answers), Counter(s for s, _, _ in answers)
        b = breakdown(before, health(url), wall, unix_start, answers)
        b["cpu_ms"] = {
            "client": round(1000 * client),
            **{k: round(1000 * v) for k, v in cpu.items()},
        }
        breakdowns.append(b)
        return sum(t for _, _, t in answers) / wall

    clients = Clients(url, num_prompts)
    try:
        in_process(0), served(0)  # warm-up (first batches, connections)
        for r in range(rounds):
            order = ("in_process", "served") if r % 2 == 0 else ("served", "in_process")
            for arm in order:
                arms[arm].append((in_process if arm == "in_process" else served)(r + 1))
            log(f"round {r + 1}: in-process {arms['in_process'][-1]:,.0f} tok/s, "
                f"served {arms['served'][-1]:,.0f} tok/s; replica: {breakdowns[-1]}")  # fmt: skip
    finally:
        clients.close()
    med = {arm: statistics.median(v) for arm, v in arms.items()}
    return {
        "rounds": rounds,
        "prompts": num_prompts,
        "new_tokens": new_tokens,
        "torch_threads": threads,
        "in_process_tok_s": round(med["in_process"]),
        "served_tok_s": round(med["served"]),
        "ratio": round(med["served"] / med["in_process"], 3),
        "in_process_all": [round(x) for x in arms["in_process"]],
        "served_all": [round(x) for x in arms["served"]],
        # Of the served rounds (warm-up excluded), the median of each figure.
        "breakdown": _medians(breakdowns[1:]),
        "in_process_cpu_ms": round(1000 * statistics.median(cpu_in[1:])),
    }


def _medians(rows: list[dict]) -> dict:
    return {k: _medians([r[k] for r in rows]) if isinstance(v, dict)
            else statistics.median(r[k] for r in rows) for k, v in rows[0].items()}  # fmt: skip


def cpu_seconds(pids: dict[str, int | None]) -> dict[str, float]:
    """User + system CPU seconds each process has used (Linux /proc; 10 ms ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError, TypeError):
            continue
    return out


def health(url: str) -> dict[str, Any]:
    import requests

    return requests.get(f"{url}/healthz", timeout=30).json()


def breakdown(
    before: dict, after: dict, wall: float, unix_start: float, answers: list
) -> dict[str, float]:
    """Where a served round's wall time went, from the replica's counters (GET /healthz):
    prefills and steps it ran, the mean rows per step, the time its decode thread was busy;
    `lead_ms`: from the first request sent to the replica's first prefill (HTTP, proxy,
    routing, parsing); `tail_ms`: from its last step to the last answer received (response
    bodies back through the proxy)."""
    keys = ("batches", "steps", "decoded_rows", "busy_s", "busy_cpu_s")
    diff = {k: after[k] - before[k] for k in keys}
    steps = max(1, diff["steps"])
    return {
        "prefills": diff["batches"],
        "steps": diff["steps"],
        "rows_per_step": round(diff["decoded_rows"] / steps, 1),
        "ms_per_step": round(1000 * diff["busy_s"] / (steps + diff["batches"]), 2),
        "decode_busy_ms": round(1000 * diff["busy_s"], 1),
        "decode_cpu_ms": round(1000 * diff["busy_cpu_s"], 1),
        "wall_ms": round(1000 * wall, 1),
        "busy_share": round(diff["busy_s"] / wall, 2),
        "lead_ms": round(1000 * (after["busy_since"] - unix_start), 1),
        "tail_ms": round(1000 * (unix_start + wall - after["idle_since"]), 1),
        "latency_p50_ms": round(1000 * statistics.median(lat for _, lat, _ in answers), 1),
    }


def soak(url: str, app: str, *, num_requests: int, concurrency: int, log=print) -> dict[str, Any]:
    """`num_requests` small completions; throughput, latency percentiles, RSS before/after."""
    pids = serve_pids(app)
    before = {name: rss_mib(pid) for name, pid in pids.items()}
    texts = prompts(64)
    bodies = [{"prompt": texts[i % 64], "max_tokens": 8, "temperature": 1.0, "seed": i}
              for i in range(num_requests)]  # fmt: skip
    start = time.perf_counter()
    answers = send(url, bodies, concurrency)
    wall = time.perf_counter() - start
    after = {name: rss_mib(pid) for name, pid in pids.items()}
    latencies = [lat for s, lat, _ in answers if s == 200]
    result = {
        "requests": num_requests,
        "concurrency": concurrency,
        "seconds": round(wall, 1),
        "requests_per_s": round(num_requests / wall, 1),
        "tokens_per_s": round(sum(t for _, _, t in answers) / wall),
        "status": dict(Counter(s for s, _, _ in answers)),
        "p50_ms": round(_pct(latencies, 0.50) * 1000, 1) if latencies else None,
        "p95_ms": round(_pct(latencies, 0.95) * 1000, 1) if latencies else None,
        "p99_ms": round(_pct(latencies, 0.99) * 1000, 1) if latencies else None,
        "rss_mib_before": {k: v and round(v) for k, v in before.items()},
        "rss_mib_after": {k: v and round(v) for k, v in after.items()},
    }
    log(f"soak: {result}")
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [f"## Serving (load {result['load']}, {result['cpus']} CPUs)", ""]
    if result.get("config"):
        lines += [f"Configuration: {result['config']}.", ""]
    if o := result.get("overhead"):
        lines += [
            "| arm | tokens/s (median) | rounds |",
            "|---|---:|---|",
            f"| in-process `Generator` | {o['in_process_tok_s']:,} | {o['in_process_all']} |",
            f"| served, 32 clients | {o['served_tok_s']:,} | {o['served_all']} |",
            "",
            f"Ratio served / in-process: **{o['ratio']}** (target >= 0.8; {o['prompts']} "
            f"prompts x {o['new_tokens']} tokens, temperature 1, {o['torch_threads']} torch "
            "thread(s)).",
            "",
        ]
        if b := o.get("breakdown"):
            in_ms = 1000 * o["prompts"] * o["new_tokens"] / o["in_process_tok_s"]
            lines += [
                "Where a served round goes (the replica's counters, median of the rounds): "
                f"wall {b['wall_ms']} ms = lead {b['lead_ms']} ms (first request sent -> first "
                f"prefill) + decoding {b['decode_busy_ms']} ms busy, of which "
                f"{b['decode_cpu_ms']} ms on a CPU ({b['prefills']} prefills, "
                f"{b['steps']} steps of {b['rows_per_step']} rows, {b['ms_per_step']} ms per "
                f"forward) + tail {b['tail_ms']} ms (last step -> last answer), the rest "
                f"waiting between steps; in process the same tokens take {in_ms:.0f} ms.",
                "",
            ]
        if cpu := (b or {}).get("cpu_ms"):
            lines += [
                "CPU per round (ms, median; 10 ms ticks): "
                + ", ".join(f"{k} {v}" for k, v in cpu.items())
                + f"; the in-process arm's decoding thread: {o.get('in_process_cpu_ms')}.",
                "",
            ]
    if s := result.get("soak"):
        lines += [
            f"Soak: {s['requests']:,} requests, {s['concurrency']} clients, {s['seconds']} s: "
            f"{s['requests_per_s']} req/s ({s['tokens_per_s']:,} tokens/s); latency p50 "
            f"{s['p50_ms']} ms, p95 {s['p95_ms']} ms, p99 {s['p99_ms']} ms; status {s['status']}; "
            f"RSS MiB before {s['rss_mib_before']}, after {s['rss_mib_after']}.",
            "",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    out = Path(args.output or "runs/bench/serve")
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="hlm-bench-serve-")
    model = args.model or tiny_model(Path(tmp.name))
    app = f"hlm-bench-{os.getpid()}"
    started_here = not ray.is_initialized()
    result: dict[str, Any] = {"model": "tiny decoder" if not args.model else args.model}
    try:
        fast = args.config == "fast"
        url = start_server(model, num_cpus=args.num_cpus, max_batch_size=args.max_batch_size,
                           app=app, max_tokens=args.new_tokens, fast=fast)  # fmt: skip
        result["config"] = CONFIGS[args.config] + (
            "" if not fast or started_here else " (Ray was already running: through the proxy)"
        )
        result["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        result["cpus"] = os.cpu_count()
        if args.rounds:
            result["overhead"] = overhead(
                url, model, rounds=args.rounds, num_prompts=args.clients,
                new_tokens=args.new_tokens, threads=max(1, int(args.num_cpus)),
                pids=serve_pids(app),
            )  # fmt: skip
        if args.soak:
            result["soak"] = soak(url, app, num_requests=args.soak, concurrency=args.concurrency)
        result["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    finally:
        serve.shutdown()
        if started_here:
            ray.shutdown()
        tmp.cleanup()
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    (out / "serve.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'serve.json'} and {out / 'serve.md'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="decoder to serve (default: a fresh tiny decoder)")
    p.add_argument("--output", help="folder for serve.json / serve.md (runs/bench/serve)")
    p.add_argument("--rounds", type=int, default=15, help="overhead rounds per arm (0: skip)")
    p.add_argument("--clients", type=int, default=32, help="prompts = concurrent clients (32)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt (32)")
    p.add_argument("--max-batch-size", type=int, default=32, help="the replica's batch (32)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of the replica (1)")
    p.add_argument("--config", choices=sorted(CONFIGS), default="fast",
                   help="how the model is served (fast: " + CONFIGS["fast"] + "; proxy: "
                   + CONFIGS["proxy"] + ")")  # fmt: skip
    p.add_argument("--soak", type=int, default=10_000, help="soak requests (0: skip)")
    p.add_argument("--concurrency", type=int, default=32, help="soak clients (32)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlm_ray.bench.serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
