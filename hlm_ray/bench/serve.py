"""The serving benchmarks: what HTTP + Ray Serve cost over in-process generation, and a soak.

    hlm bench --only serve                                   # both, on a fresh tiny decoder
    python -m hlm_ray.bench.serve --model runs/tiny-gen --rounds 15 --soak 10000
    python -m hlm_ray.bench.serve --soak 0                   # the overhead ratio only
    python -m hlm_ray.bench.serve --config plain --soak 0    # the plain path, for comparison

The server is started as `hlm serve` starts it, from `hlm serve`'s own options and defaults
(`--config default`: a decode process per replica, the replica answering its port itself, past
Serve's proxy; `--config plain`: `--no-decode-process --no-direct-ingress`), with the
benchmark's batch size (`--max-batch-size`, 32: one batch for the 32 clients).

Overhead: the same decoder and prompts (32 prompts x 32 new tokens, temperature 1) decoded by
`Generator.generate` in this process (one batch) and served to 32 concurrent HTTP clients (one
prompt each) at the URL `hlm serve` names; with the default configuration a third arm sends the
same requests through Serve's proxy to the same replica, after the target pair. Each HTTP arm
alternates with the in-process arm (in, served, served, in, ...) in one run and each arm's figure
is its median round, in completion tokens per second. The in-process arm uses the replica's torch thread count. Target: served / in-process
>= 0.8. Each served round also reads the replica's counters (`GET /healthz`) for where its time
went (`breakdown`): prefills, steps and rows per step of the continuous batch, the decode loop's
busy time and ms per step, the lead from the first request sent to the first prefill (HTTP,
routing, parsing), the tail from the last step to the last answer, and the CPU time the clients,
the proxy, the replica and its decode process used (`/proc/PID/stat`).

Soak: `--soak` requests (small completions, `--concurrency` clients) against the same server:
throughput, p50/p95/p99 latency, every status code, and the resident memory (RSS) of the
replica and the proxy before and after. Loopback only; the Ray instance started here is shut
down. Results: printed as Markdown and written to `--output` (serve.json, serve.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hlm_ray.bench.serve_clients import Clients, percentile, send
from hlm_ray.bench.serve_report import breakdown, markdown, summary
from hlm_ray.errors import HLMError, exit_status

CONFIGS = {
    "default": "`hlm serve`'s defaults: the replica answers HTTP itself (direct ingress) and "
    "decodes in a process of its own",
    "plain": "`hlm serve --no-decode-process --no-direct-ingress`: through Ray Serve's proxy, "
    "decoding on the replica's thread",
}
PROMPT_WORDS = ["cat", "house", "river", "Paris", "green", "music", "stone", "winter"]


def tiny_model(root: Path) -> str:
    """A tiny vanilla decoder under `root` (trained 2 steps, for the tokenizer and the folder
    layout, then given random weights of std 0.15 so that its logits are peaked and its text
    varied): the serving benchmark's model, and the test suite's (`tests/conftest.py`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hlm_ray.presets import load_config
    from hlm_ray.train.loop import train_worker

    old = os.environ.get("HLM_CACHE_DIR")
    os.environ["HLM_CACHE_DIR"] = str(root / "cache")  # its tokenizer never lands elsewhere
    try:
        cfg = load_config(
            "tiny-decoder",
            objective="vanilla",
            overrides={"optim.max_steps": 2, "run.output_dir": str(root / "run")},
        )
        model_dir = train_worker(cfg.to_dict(), progress=False)["model_dir"]
    finally:
        if old is None:
            del os.environ["HLM_CACHE_DIR"]
        else:
            os.environ["HLM_CACHE_DIR"] = old
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


def start_server(model: str, *, config: str, num_cpus: float, max_batch_size: int,
                 max_tokens: int, niceness: int | None = None):  # fmt: skip
    """Serve `model` as `hlm serve` would with `config` (its options parsed by its own parser),
    on free loopback ports, in a Ray started here; returns the `launch.Ports`."""
    from hlm_ray.serve.app import make_app
    from hlm_ray.serve.cli import add_arguments, app_args
    from hlm_ray.serve.launch import Ports, start
    from hlm_ray.tracking.server import free_port

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", model, "--max-batch-size", str(max_batch_size), "--num-cpus", str(num_cpus)]
    if config == "plain":
        argv += ["--no-decode-process", "--no-direct-ingress"]
    if niceness is not None:
        argv += ["--niceness", str(niceness)]
    options = parser.parse_args(argv)
    args = app_args(options).model_copy(update={"max_tokens_limit": max(256, max_tokens)})
    direct = options.direct_ingress is not False
    ports = Ports.plan("127.0.0.1", free_port(), replicas=1, direct=direct,
                       proxy_port=free_port() if direct else None)  # fmt: skip
    ray = {"address": "local", "num_cpus": 2, "include_dashboard": False}
    start(make_app(args, num_cpus=num_cpus, niceness=options.niceness), ports, guard={}, ray=ray)
    return ports


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


def stat_fields(pid: int | str | None) -> list[str]:
    """`/proc/PID/stat` after the command name (which may hold spaces and parentheses): index 0
    is field 3 of proc(5), the state. Raises OSError for a process that is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def nice_of(pid: int | None) -> int | None:
    """A process's scheduling niceness (Linux /proc), as it runs."""
    try:
        return int(stat_fields(pid)[16])
    except (OSError, ValueError, IndexError):
        return None


def processes() -> dict[int, tuple[str, int]]:
    """Every process on this machine: pid -> (command line, parent pid) (Linux /proc)."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int(stat_fields(entry.name)[1])
            except (OSError, ValueError, IndexError):
                continue
            procs[int(entry.name)] = (cmd, ppid)
    return procs


def serve_pids(app: str) -> dict[str, int | None]:
    """The replica of `app` and the proxy beside it (same raylet), found by process title."""
    procs = processes()
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


# ----------------------------------------------------------------------------- benchmarks


def overhead(url: str, model: str, *, rounds: int, num_prompts: int, new_tokens: int,
             threads: int, pids: dict[str, int | None] | None = None,
             proxy_url: str | None = None, log=print) -> dict[str, Any]:  # fmt: skip
    """Served vs in-process tokens/s, arms alternated; medians and the ratio. `proxy_url`: a
    third arm, the same requests through Serve's proxy. `pids` (the replica's and the proxy's,
    `serve_pids`) adds each process's CPU time per served round."""
    import torch

    from hlm_ray.generate import Generator

    torch.set_num_threads(threads)
    gen = Generator.load(model, device="cpu")
    texts = prompts(num_prompts)
    arms: dict[str, list[float]] = {"in_process": [], "served": [], "proxy": [], "in_proxy": []}
    breakdowns: list[dict[str, float]] = []
    cpu_in: list[float] = []

    def in_process(seed: int) -> float:
        start, cpu = time.perf_counter(), time.thread_time()
        out = gen.generate(texts, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
        cpu_in.append(time.thread_time() - cpu)
        return sum(c.completion_tokens for c in out) / (time.perf_counter() - start)

    def served(seed: int, arm: str = "served") -> float:
        bodies = [{"prompt": p, "max_tokens": new_tokens, "temperature": 1.0, "seed": seed}
                  for p in texts]  # fmt: skip
        counted = arm == "served"  # the side arm's rounds report no breakdown
        before, cpu = (health(url), cpu_seconds(pids or {})) if counted else (None, None)
        start, unix_start, client = time.perf_counter(), time.time(), time.process_time()
        answers = clients[arm].send(bodies)
        wall = time.perf_counter() - start
        client = time.process_time() - client
        assert all(s == 200 for s, _, _ in answers), Counter(s for s, _, _ in answers)
        if counted:
            cpu = {k: v - cpu[k] for k, v in cpu_seconds(pids or {}).items()}
            b = breakdown(before, health(url), wall, unix_start, answers)
            b["cpu_ms"] = {
                "client": round(1000 * client),
                **{k: round(1000 * v) for k, v in cpu.items()},
            }
            breakdowns.append(b)
        return sum(t for _, _, t in answers) / wall

    def alternate(local: str, remote: str, remote_url: str) -> None:
        """`rounds` rounds of the in-process arm (figures in arms[local]) and one HTTP arm,
        A B B A ..., after a warm-up round of each (first batches, connections)."""
        clients[remote] = Clients(remote_url, num_prompts)
        try:
            in_process(0)
            served(0, remote)
            for r in range(rounds):
                for arm in (local, remote) if r % 2 == 0 else (remote, local):
                    arms[arm].append(in_process(r + 1) if arm == local else served(r + 1, remote))
                log(f"{remote} round {r + 1}: in_process {arms[local][-1]:,.0f}, "
                    f"{remote} {arms[remote][-1]:,.0f} tok/s"
                    + (f"; replica: {breakdowns[-1]}" if remote == "served" else ""))  # fmt: skip
        finally:
            clients.pop(remote).close()

    # The target pair alternates only with itself: a third arm between its rounds (the proxy's
    # 32 connections and its work after each round) would be timed into the served figure,
    # which the default server, whose clients never touch the proxy, does not pay.
    clients: dict[str, Clients] = {}
    alternate("in_process", "served", url)
    if proxy_url:  # the side arm, after: the same requests through Serve's proxy
        alternate("in_proxy", "proxy", proxy_url)
    return summary(arms, breakdowns, cpu_in, rounds=rounds, prompts=num_prompts,
                   new_tokens=new_tokens, threads=threads)  # fmt: skip


def cpu_seconds(pids: dict[str, int | None]) -> dict[str, float]:
    """User + system CPU seconds each process has used (Linux /proc; 10 ms ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = stat_fields(pid)
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError, TypeError):
            continue
    return out


def health(url: str) -> dict[str, Any]:
    import requests

    return requests.get(f"{url}/healthz", timeout=30).json()


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
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 1) if latencies else None,
        "p95_ms": round(percentile(latencies, 0.95) * 1000, 1) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 1) if latencies else None,
        "rss_mib_before": {k: v and round(v) for k, v in before.items()},
        "rss_mib_after": {k: v and round(v) for k, v in after.items()},
    }
    log(f"soak: {result}")
    return result


def check_lengths(model: str, num_prompts: int, new_tokens: int) -> None:
    """Fail before Ray starts (tens of seconds) when the benchmark's prompts with
    `--new-tokens` do not fit the model's positions (the tiny decoder has 128)."""
    from hlm_ray.generate import Generator, SamplingParams

    gen = Generator.load(model, device="cpu", weights=False)  # tokenizer and limits only
    try:
        gen.rows(prompts(num_prompts), SamplingParams(max_new_tokens=new_tokens))
    except HLMError as err:
        raise HLMError(f"--new-tokens {new_tokens}: {err}") from None


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    out = Path(args.output or "runs/bench/serve")
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="hlm-bench-serve-")
    model = args.model or tiny_model(Path(tmp.name))
    if args.rounds:
        check_lengths(model, args.clients, args.new_tokens)
    app = "hlm"  # the application's name (`launch.start`), which finds its processes
    result: dict[str, Any] = {"model": "tiny decoder" if not args.model else args.model}
    started = time.perf_counter()
    try:
        ports = start_server(model, config=args.config, num_cpus=args.num_cpus,
                             max_batch_size=args.max_batch_size, max_tokens=args.new_tokens,
                             niceness=args.niceness)  # fmt: skip
        result["config"] = CONFIGS[args.config]
        result["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        result["cpus"] = os.cpu_count()
        pids = serve_pids(app)
        result["niceness"] = {k: nice_of(pid) for k, pid in pids.items() if k != "proxy"}
        if args.rounds:
            result["overhead"] = overhead(
                ports.url, model, rounds=args.rounds, num_prompts=args.clients,
                new_tokens=args.new_tokens, threads=max(1, int(args.num_cpus)),
                pids=pids, proxy_url=ports.proxy_url if ports.direct else None,
            )  # fmt: skip
        if args.soak:
            result["soak"] = soak(
                ports.url, app, num_requests=args.soak, concurrency=args.concurrency
            )
        result["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        tmp.cleanup()
    result["wall_s"] = round(time.perf_counter() - started, 1)
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
    p.add_argument("--config", choices=sorted(CONFIGS), default="default",
                   help="how the model is served (default: " + CONFIGS["default"] + "; plain: "
                   + CONFIGS["plain"] + ")")  # fmt: skip
    p.add_argument(
        "--niceness",
        type=int,
        choices=range(20),
        metavar="0-19",
        help="the replica's niceness (default: hlm serve's, 0; 15: Ray's default)",
    )
    p.add_argument("--soak", type=int, default=10_000, help="soak requests (0: skip)")
    p.add_argument("--concurrency", type=int, default=32, help="soak clients (32)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlm_ray.bench.serve", description=__doc__)
    add_arguments(parser)
    return exit_status(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
