"""The serving benchmark's arithmetic (`hlm_ray.bench.serve_report`): the breakdown of a served
round from the replica's counters, the decode process's speed against the in-process arm's, and
the Markdown. The benchmark itself runs with `hlm bench`."""

from __future__ import annotations

from hlm_ray.bench.serve_report import breakdown, decode_speed, markdown


def test_breakdown_of_a_served_round_from_the_replica_counters():
    before = {"batches": 10, "steps": 100, "decoded_rows": 900, "busy_s": 1.0,
              "busy_cpu_s": 0.5, "busy_since": 50.0, "idle_since": 60.0}  # fmt: skip
    after = {"batches": 13, "steps": 133, "decoded_rows": 900 + 33 * 30, "busy_s": 1.108,
             "busy_cpu_s": 0.58, "busy_since": 1000.05, "idle_since": 1000.19,
             "submitted_at": 1000.03, "stepping_since": 1000.07}  # fmt: skip
    answers = [(200, 0.1, 32), (200, 0.2, 32), (200, 0.3, 32)]
    b = breakdown(before, after, wall=0.2, unix_start=1000.0, answers=answers)
    assert b["prefills"] == 3 and b["steps"] == 33 and b["rows_per_step"] == 30.0
    assert b["decode_cpu_ms"] == 80.0
    assert b["decode_busy_ms"] == 108.0 and b["ms_per_step"] == 3.0  # 108 ms / 36 forwards
    assert b["lead_ms"] == 50.0 and b["tail_ms"] == 10.0
    assert b["arrivals_ms"] == 30.0 and b["catch_up_ms"] == 40.0
    assert b["busy_share"] == 0.54 and b["latency_p50_ms"] == 200.0
    overhead = {"in_process_tok_s": 10240, "served_tok_s": 5120, "ratio": 0.5,
                "in_process_all": [10240], "served_all": [5120], "prompts": 32,
                "new_tokens": 32, "torch_threads": 1, "breakdown": b}  # fmt: skip
    text = markdown({"load": "1.0 1.0 1.0", "cpus": 2, "overhead": overhead})
    assert "**0.5**" in text and "lead 50.0 ms" in text and "take 100 ms" in text
    assert "proxy" not in text  # no proxy arm measured: none reported
    assert "the last request to the decoder 30.0 ms after" in text and "came 40.0 ms" in text
    older = breakdown(before, {k: v for k, v in after.items() if k != "submitted_at"}, wall=0.2,
                      unix_start=1000.0, answers=answers)  # fmt: skip
    assert "arrivals_ms" not in older  # a server without the counters: no made-up spans
    assert "Per forward pass" not in text  # no in-process CPU measured: no comparison
    # 80 ms over 36 forwards served against 68 ms over 34 in process: 2.22 / 2.0 ms.
    assert decode_speed(overhead | {"in_process_cpu_ms": 68}) == 1.11
    text = markdown({"load": "1", "cpus": 2, "overhead": overhead | {"in_process_cpu_ms": 68}})
    assert "the decode process used **1.11** times the CPU" in text
    # With the default configuration, the same requests through Serve's proxy as a side arm.
    overhead |= {"proxy_tok_s": 3072, "proxy_ratio": 0.3, "proxy_all": [3072]}
    text = markdown({"load": "1.0 1.0 1.0", "cpus": 2, "overhead": overhead, "wall_s": 61.5})
    assert "| the same through Serve's proxy | 3,072 | [3072] |" in text
    assert "**0.5**; through the proxy 0.3" in text and "61.5 s in all" in text
