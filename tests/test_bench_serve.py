"""The serving benchmark's arithmetic (`hlm_ray.bench.serve_report`): the breakdown of a served
round from the replica's counters, the decode process's speed against the in-process arm's, and
the Markdown. The benchmark itself runs with `hlm bench`."""

from __future__ import annotations

import pytest

from hlm_ray.bench.serve_report import breakdown, decode_speed, markdown
from hlm_ray.errors import HLMError


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


def test_a_runs_summary_holds_each_arms_median_the_ratios_and_the_decode_speed():
    """serve.json's `overhead` from the rounds: medians, ratios against the in-process rounds
    each HTTP arm alternated with, warm-ups left out, and the decode process's speed stored
    (not only printed), so that runs compare from their JSON."""
    from hlm_ray.bench.serve_report import summary

    served = {"prefills": 3, "steps": 31, "decode_cpu_ms": 80.0}
    breakdowns = [{"prefills": 9, "steps": 99, "decode_cpu_ms": 999.0}] + [served] * 3
    arms = {"in_process": [10000, 12000, 11000], "served": [8000, 9000, 8500],
            "in_proxy": [], "proxy": []}  # fmt: skip
    cpu_in = [0.5, 0.064, 0.064, 0.064]  # the warm-up first: 500 ms, never the median
    s = summary(arms, breakdowns, cpu_in, rounds=3, prompts=32, new_tokens=32, threads=1)
    assert s["in_process_tok_s"] == 11000 and s["served_tok_s"] == 8500
    assert s["ratio"] == round(8500 / 11000, 3) and s["in_process_cpu_ms"] == 64
    assert s["breakdown"] == served  # the warm-up round's breakdown left out
    # 80 ms over 34 forwards served against 64 ms over 32 in process: 2.353 / 2.0 ms.
    assert s["decode_speed"] == 1.18
    assert "proxy_ratio" not in s  # no proxy arm ran
    arms |= {"in_proxy": [10000, 10000], "proxy": [4000, 5000]}
    s = summary(arms, breakdowns, cpu_in, rounds=3, prompts=32, new_tokens=32, threads=1)
    assert s["proxy_tok_s"] == 4500 and s["proxy_ratio"] == 0.45


def test_new_tokens_beyond_the_models_positions_fail_before_ray_starts(
    tiny_decoder_dir, tmp_path, monkeypatch, capsys
):
    """The tiny decoder has 128 positions: 12-token prompts with --new-tokens 128 do not fit.
    The benchmark says so at once, in one line with the option's name, rather than after
    starting Ray and the server (another test of this worker may hold a Ray of its own, so the
    check is that the server is never started)."""
    from hlm_ray.bench import serve

    def never(*args, **kwargs):
        raise AssertionError("the server was started before the lengths were checked")

    monkeypatch.setattr(serve, "start_server", never)
    argv = ["--model", tiny_decoder_dir, "--new-tokens", "128", "--output", str(tmp_path)]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --new-tokens 128: prompt has ") and err.count("\n") == 1
    with pytest.raises(HLMError, match=r"--new-tokens 128: prompt has \d+ tokens and "
                       r"max_new_tokens=128: together more than the model's 128 positions"):  # fmt: skip
        serve.check_lengths(tiny_decoder_dir, 32, 128)
    serve.check_lengths(tiny_decoder_dir, 32, 96)  # 96 fits


def test_the_engines_table_gives_each_rows_ratio_and_the_start_ups():
    from hlm_ray.bench.serve_engines import markdown as engines_markdown

    def row(n, engine, rate, ttft, p99):
        return {"clients": n, "engine": engine, "tokens_per_s": rate, "ttft_median_ms": ttft,
                "ttft_p99_ms": p99, "requests": n, "rounds": [rate]}  # fmt: skip

    results = [{"size": "tiny", "startup_s": {"hlm": 12.4, "vllm": 95.6},
                "rows": [row(1, "hlm", 200, 10, 20), row(1, "vllm", 300, 30, 40),
                         row(8, "vllm", 400, 50, 60), row(8, "hlm", 1600, 5, 6)]}]  # fmt: skip
    text = engines_markdown(results)
    assert "| tiny | 1 | 200 | 300 | 1.50x | 10 / 30 | 20 / 40 |" in text
    assert "| tiny | 8 | 1600 | 400 | 0.25x | 5 / 50 | 6 / 60 |" in text
    assert "| tiny | 12 | 96 |" in text


def test_the_engines_benchmark_refuses_bad_numbers_and_a_missing_vllm(monkeypatch, capsys):
    from hlm_ray.bench import serve_engines
    from hlm_ray.serve.vllm import flags

    assert serve_engines.main(["--rounds", "0"]) == 2
    assert (
        "--rounds, --new-tokens and every --clients value must be >= 1" in capsys.readouterr().err
    )
    monkeypatch.setattr(flags, "vllm_installed", lambda: False)
    assert serve_engines.main([]) == 2
    assert "make setup-vllm" in capsys.readouterr().err
    with pytest.raises(HLMError, match="--sizes: 'huge' is not one of tiny, pythia-70m"):
        serve_engines.make_model("huge", None)
