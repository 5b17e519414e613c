"""Keyed completions during a connection flood: their latency before, during and after.

    python -m hlm_ray.bench.flood                          # a fresh tiny decoder, 90 s of flood
    python -m hlm_ray.bench.flood --model runs/tiny-gen --flood-s 90 --connections 10300

Starts `HLM_API_KEY=<random> hlm serve --model M --port P` with every other option at its
default (direct ingress; the connection guard: 4096 connections, 1024 per address, headers due
within 10 s) in a process group of its own, then, from loopback:
  - before: a keyed completion (8 tokens, a new connection each) from 127.0.0.1 every
    `--interval-s`, for `--phase-s`;
  - flood: two attackers, 127.0.0.2 and 127.0.0.3 (a process each), each holding up to
    `--connections` connections that never finish their headers (one more header line every
    5 s) and reopening every one the server closes, for `--flood-s`, while the keyed
    completions go on;
  - after: as before, once the attackers have closed theirs.
It prints, per phase, how many keyed completions were answered 200 and their latency (p50,
p90, p99, max); the attackers' connections opened and how the server answered them (408 at the
header deadline, 503 past a limit, closed without an answer); the load average every second of
the flood (mean and max). Results: printed as Markdown, and written to `--output` (flood.json,
flood.md). The machine's own load shows in the tail: measure on an idle machine for figures to
compare, and say the load beside any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ATTACKERS = ("127.0.0.2", "127.0.0.3")
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"  # headers never finished


# ----------------------------------------------------------------------------- the attacker


async def _hold(source: str, port: int, connections: int, seconds: float) -> Counter:
    """Up to `connections` connections from `source` that never finish their headers, each
    reopened when the server closes it, until `seconds` have passed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    stats: Counter = Counter()

    async def one() -> None:
        writer = None
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
            stats["opened"] += 1
            writer.write(PARTIAL)
            while loop.time() < end:
                try:
                    data = await asyncio.wait_for(reader.read(64), timeout=5.0)
                except TimeoutError:
                    writer.write(b"X-Still-Here: 1\r\n")  # never the blank line that ends them
                    continue
                if data.startswith(b"HTTP/1.1 "):
                    stats[f"answered {data[9:12].decode()}"] += 1
                else:
                    stats["closed without an answer"] += 1
                return
        except OSError as err:
            stats[f"connect failed: {err.strerror or type(err).__name__}"] += 1
            await asyncio.sleep(0.05)  # the port range or a backlog is full: not a hot loop
        finally:
            if writer is not None:
                writer.close()

    async def slot() -> None:
        while loop.time() < end:
            await one()

    await asyncio.gather(*(slot() for _ in range(connections)))
    return stats


def attacker_main(source: str, port: int, connections: int, seconds: float) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stats = asyncio.run(_hold(source, port, connections, seconds))
    print(json.dumps(dict(stats)), flush=True)


# ----------------------------------------------------------------------------- the client


def keyed(port: int, key: str, seconds: float, interval: float) -> list[tuple[int, float]]:
    """(status, seconds) of a keyed completion sent every `interval` for `seconds`; status 0:
    no answer (a reset, a timeout)."""
    body = json.dumps({"prompt": "The cat sat on the", "max_tokens": 8, "temperature": 0})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tick = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            status = conn.getresponse().status
        except OSError:
            status = 0
        finally:
            conn.close()
        out.append((status, time.monotonic() - tick))
        time.sleep(max(0.0, interval - (time.monotonic() - tick)))
    return out


def percentiles(latencies: list[float]) -> dict[str, float]:
    from hlm_ray.bench.serve_clients import percentile

    if not latencies:
        return {}
    return {
        "p50": percentile(latencies, 0.5),
        "p90": percentile(latencies, 0.9),
        "p99": percentile(latencies, 0.99),
        "max": max(latencies),
    }


def phase(answers: list[tuple[int, float]]) -> dict:
    ok = [s for st, s in answers if st == 200]
    return {"sent": len(answers), "statuses": dict(Counter(st for st, _ in answers)),
            **percentiles(ok)}  # fmt: skip


# ----------------------------------------------------------------------------- the run


def serve(model: str, port: int, key: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HLM_API_KEY": key, "RAY_ADDRESS": "local"}
    cmd = [sys.executable, "-m", "hlm_ray.cli", "serve", "--model", model, "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def wait_ready(port: int, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"hlm serve exited with {server.returncode}; see its log")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("hlm serve did not answer /healthz in time")


def run(args) -> dict:
    from hlm_ray.tracking.server import free_port

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from hlm_ray.bench.serve import tiny_model

        model = tiny_model(Path(tempfile.mkdtemp(prefix="hlm-flood-")))
    key, port = secrets.token_hex(16), free_port()
    server = serve(model, port, key, out / "serve.log")
    say = lambda line: print(f"[flood] {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"starting hlm serve on port {port} (its log: {out / 'serve.log'})")
    try:
        wait_ready(port, server)
        say(f"serving; keyed completions for {args.phase_s:g} s before the flood")
        result = {"load_before": os.getloadavg(), "cpus": os.cpu_count(),
                  "connections_per_attacker": args.connections, "flood_s": args.flood_s,
                  "interval_s": args.interval_s}  # fmt: skip
        keyed(port, key, 3 * args.interval_s, args.interval_s)  # warm-up: first batches
        result["before"] = phase(keyed(port, key, args.phase_s, args.interval_s))
        loads: list[float] = []
        flood_on = threading.Event()
        flood_on.set()

        def sample() -> None:
            while flood_on.is_set():
                loads.append(os.getloadavg()[0])
                time.sleep(1)

        threading.Thread(target=sample, daemon=True).start()
        attackers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hlm_ray.bench.flood",
                    "--attacker",
                    source,
                    "--port",
                    str(port),
                    "--connections",
                    str(args.connections),
                    "--flood-s",
                    str(args.flood_s),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for source in ATTACKERS
        ]
        say(f"flood: 2 attackers × {args.connections:,} connections for {args.flood_s:g} s")
        time.sleep(2)  # the attackers' connections are open before the first keyed one
        result["flood"] = phase(keyed(port, key, args.flood_s - 4, args.interval_s))
        result["attackers"] = [json.loads(a.communicate(timeout=120)[0] or "{}") for a in attackers]
        flood_on.clear()
        result["load_during"] = {"mean": sum(loads) / max(1, len(loads)), "max": max(loads or [0])}
        time.sleep(args.interval_s)
        say(f"flood over; keyed completions for {args.phase_s:g} s after it")
        result["after"] = phase(keyed(port, key, args.phase_s, args.interval_s))
        result["load_after"] = os.getloadavg()
    finally:
        os.killpg(server.pid, signal.SIGINT)  # hlm serve's own shutdown
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    (out / "flood.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "flood.md").write_text(md)
    print(md)
    return result


def markdown(r: dict) -> str:
    def ms(x):
        return f"{x * 1000:.0f} ms" if x is not None else "-"

    rows = ["| phase | keyed sent | answered 200 | p50 | p90 | p99 | max |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ("before", "flood", "after"):
        p = r[name]
        rows.append(
            f"| {name} | {p['sent']} | {p['statuses'].get(200, p['statuses'].get('200', 0))} | "
            + " | ".join(ms(p.get(q)) for q in ("p50", "p90", "p99", "max"))
            + " |"
        )
    attacks = "; ".join(
        f"{src}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(a.items()))
        for src, a in zip(ATTACKERS, r["attackers"], strict=True)
    )
    load = ", ".join(f"{x:.2f}" for x in r["load_before"])
    return (
        f"Flood: 2 attackers × up to {r['connections_per_attacker']:,} connections for "
        f"{r['flood_s']:g} s; a keyed completion every {r['interval_s']:g} s; {r['cpus']} CPUs; "
        f"load average before {load}, during the flood {r['load_during']['mean']:.1f} on average "
        f"(max {r['load_during']['max']:.1f}).\n\n"
        + "\n".join(rows)
        + f"\n\nAttackers: {attacks}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hlm_ray.bench.flood", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="a decoder folder or models:/ URI (default: a fresh tiny one)")
    p.add_argument("--connections", type=int, default=10_300, help="per attacker (10300)")
    p.add_argument("--flood-s", type=float, default=90.0, help="how long the flood lasts (90)")
    p.add_argument("--phase-s", type=float, default=20.0, help="before and after it (20)")
    p.add_argument("--interval-s", type=float, default=0.5, help="between keyed requests (0.5)")
    p.add_argument("--output", default="runs/bench/flood", help="flood.json, flood.md, serve.log")
    p.add_argument("--attacker", help=argparse.SUPPRESS)  # internal: one attacker process
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.attacker:
        attacker_main(args.attacker, args.port, args.connections, args.flood_s)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
