"""The serving benchmark's arithmetic and report (`hlm_ray.bench.serve` measures): where a
served round went, from the replica's counters; a run's summary (serve.json's `overhead`); how
fast the decode process ran the same forward passes as the in-process arm; and the Markdown of a
run (serve.md)."""

from __future__ import annotations

import statistics
from typing import Any


def breakdown(
    before: dict, after: dict, wall: float, unix_start: float, answers: list
) -> dict[str, float]:
    """Where a served round's wall time went, from the replica's counters (GET /healthz):
    prefills and steps it ran, the mean rows per step, the time its decode thread was busy;
    `lead_ms`: from the first request sent to the replica's first prefill (HTTP, proxy,
    routing, parsing); `arrivals_ms`: to the last request handed to the decoder (the replica
    reading every request of the round, one after another); `catch_up_ms`: from there to the
    first step (the prefills still owed); `tail_ms`: from the last step to the last answer
    received (response bodies back through the proxy)."""
    keys = ("batches", "steps", "decoded_rows", "busy_s", "busy_cpu_s")
    diff = {k: after[k] - before[k] for k in keys}
    steps = max(1, diff["steps"])
    spans = {}
    if after.get("submitted_at") and after.get("stepping_since"):  # a server that reports them
        spans = {
            "arrivals_ms": round(1000 * (after["submitted_at"] - unix_start), 1),
            "catch_up_ms": round(1000 * (after["stepping_since"] - after["submitted_at"]), 1),
        }
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
        **spans,
        "tail_ms": round(1000 * (unix_start + wall - after["idle_since"]), 1),
        "latency_p50_ms": round(1000 * statistics.median(lat for _, lat, _ in answers), 1),
    }


def medians(rows: list[dict]) -> dict:
    """Each figure's median over the rounds' breakdowns (nested dicts figure by figure)."""
    return {k: medians([r[k] for r in rows]) if isinstance(v, dict)
            else statistics.median(r[k] for r in rows) for k, v in rows[0].items()}  # fmt: skip


def summary(arms: dict[str, list[float]], breakdowns: list[dict], cpu_in: list[float], *,
            rounds: int, prompts: int, new_tokens: int, threads: int) -> dict[str, Any]:  # fmt: skip
    """A run's overhead figures (serve.json's `overhead`) from its rounds: `arms` holds each
    arm's tokens/s per round (in_process, served; in_proxy, proxy when the proxy arm ran),
    `breakdowns` the served rounds' (the first is the warm-up), `cpu_in` the in-process arm's
    CPU seconds per round (its warm-up first)."""
    med = {arm: statistics.median(v) for arm, v in arms.items() if v}
    result = {
        "rounds": rounds,
        "prompts": prompts,
        "new_tokens": new_tokens,
        "torch_threads": threads,
        "in_process_tok_s": round(med["in_process"]),
        "served_tok_s": round(med["served"]),
        "ratio": round(med["served"] / med["in_process"], 3),
        "in_process_all": [round(x) for x in arms["in_process"]],
        "served_all": [round(x) for x in arms["served"]],
        # Of the served rounds (warm-up excluded), the median of each figure.
        "breakdown": medians(breakdowns[1:]),
        # The target pair's in-process rounds: cpu_in[0] is their warm-up.
        "in_process_cpu_ms": round(1000 * statistics.median(cpu_in[1 : rounds + 1])),
    }
    result["decode_speed"] = decode_speed(result)
    if "proxy" in med:  # against the in-process rounds it alternated with
        result["proxy_tok_s"] = round(med["proxy"])
        result["proxy_ratio"] = round(med["proxy"] / med["in_proxy"], 3)
        result["proxy_all"] = [round(x) for x in arms["proxy"]]
    return result


def decode_speed(overhead: dict[str, Any]) -> float | None:
    """The decode process's CPU per forward pass ÷ the in-process arm's, from a run's medians:
    how much of a run's ratio is the machine (which core each decoder got, what shared it)
    rather than the HTTP path. In process a round is 1 prefill + the same steps."""
    b, in_ms = overhead.get("breakdown"), overhead.get("in_process_cpu_ms")
    if not b or not in_ms or not b.get("decode_cpu_ms"):
        return None
    served = b["decode_cpu_ms"] / (b["prefills"] + b["steps"])
    return round(served / (in_ms / (1 + b["steps"])), 2)


def markdown(result: dict[str, Any]) -> str:
    wall = f", {result['wall_s']} s in all" if "wall_s" in result else ""
    lines = [f"## Serving (load {result['load']}, {result['cpus']} CPUs{wall})", ""]
    if result.get("config"):
        nice = ", ".join(f"{k} {v}" for k, v in result.get("niceness", {}).items())
        lines += [f"Configuration: {result['config']}" + (f" (niceness: {nice})" if nice else "")
                  + ".", ""]  # fmt: skip
    if o := result.get("overhead"):
        lines += [
            "| arm | tokens/s (median) | rounds |",
            "|---|---:|---|",
            f"| in-process `Generator` | {o['in_process_tok_s']:,} | {o['in_process_all']} |",
            f"| served, 32 clients | {o['served_tok_s']:,} | {o['served_all']} |",
        ]
        if "proxy_tok_s" in o:
            lines += [f"| the same through Serve's proxy | {o['proxy_tok_s']:,} | "
                      f"{o['proxy_all']} |"]  # fmt: skip
        proxy = f"; through the proxy {o['proxy_ratio']}" if "proxy_ratio" in o else ""
        lines += [
            "",
            f"Ratio served / in-process: **{o['ratio']}**{proxy} (target >= 0.8; "
            f"{o['prompts']} prompts x {o['new_tokens']} tokens, temperature 1, "
            f"{o['torch_threads']} torch thread(s)).",
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
            if "arrivals_ms" in b:
                lines += [
                    f"The replica handed the last request to the decoder {b['arrivals_ms']} ms "
                    "after the first was sent (it reads them one after another), and the "
                    f"decoder's first step came {b['catch_up_ms']} ms after that (the prefills "
                    "still owed); in process, one prefill of the whole batch comes first.",
                    "",
                ]
        if cpu := (b or {}).get("cpu_ms"):
            lines += [
                "CPU per round (ms, median; 10 ms ticks): "
                + ", ".join(f"{k} {v}" for k, v in cpu.items())
                + f"; the in-process arm's decoding thread: {o.get('in_process_cpu_ms')}.",
                "",
            ]
        if speed := decode_speed(o):
            lines += [
                f"Per forward pass, the decode process used **{speed}** times the CPU of the "
                "in-process arm (its decode loop's CPU per prefill or step, against the "
                "in-process arm's per prefill or step, medians): above 1, the decode process "
                "ran the same passes slower, and the ratio above reads lower for it.",
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
