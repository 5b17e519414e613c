"""Continuous batching (`hlm_ray.batching.RunningBatch`): rows that join a running batch at any
step, leave it early, or are split off and merged back decode exactly what they decode alone
with the same seed; the cache stays as wide as the longest running row."""

from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch

from hlm_ray.batching import RunningBatch, cache_keyword, returned_cache
from hlm_ray.generate import Generator, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The cat sat on the", "Once", "", "In 1999 the city of New York had a population"]


@pytest.fixture(scope="module")
def gen(tiny_decoder_dir) -> Generator:
    return Generator.load(tiny_decoder_dir)


def _requests(gen: Generator) -> list[list]:
    """Four requests of different lengths and settings (sampled with seeds, greedy, stop
    sequences, logprobs, prompt scoring)."""
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
    return [
        gen.rows(PROMPTS[0], sampled, seed=7, n=2),
        gen.rows(PROMPTS[1], SamplingParams(max_new_tokens=5, temperature=0)),
        gen.rows(
            PROMPTS[3],
            SamplingParams(max_new_tokens=9, temperature=0.8, top_k=50, logprobs=2, stop=("e ",)),
            seed=1,
        ),  # fmt: skip
        gen.rows(
            PROMPTS[2],
            SamplingParams(max_new_tokens=7, temperature=1.0, prompt_logprobs=True, logprobs=0),
            seed=3,
        ),  # fmt: skip
    ]


def _alone(gen: Generator, rows: list) -> list:
    out = []
    for row in rows:
        fresh = type(row)(row.prompt_ids, row.params, row.seed)
        out.append(gen.complete_rows([fresh])[0])
    return out


def _same(got, expected) -> None:
    assert got.text == expected.text
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert got.completion_tokens == expected.completion_tokens
    if expected.logprobs is not None:
        assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in expected.logprobs]
        for a, b in zip(got.logprobs, expected.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    if expected.prompt_logprobs is not None:
        got_lp = [lp and lp.logprob for lp in got.prompt_logprobs]
        assert got_lp == pytest.approx([lp and lp.logprob for lp in expected.prompt_logprobs],
                                       abs=1e-4)  # fmt: skip


def test_rows_joining_a_running_batch_decode_what_they_decode_alone(gen):
    requests = _requests(gen)
    expected = [_alone(gen, rows) for rows in requests]
    batch = RunningBatch(gen)
    batch.admit(requests[0])
    for _ in range(3):
        batch.step()
    batch.admit(requests[1] + requests[2])  # two requests join at step 3, together
    widths = []
    for step in range(100):
        if step == 2:
            batch.admit(requests[3])  # the empty prompt (one EOS token) joins later still
        widths.append(batch._mask_BL.shape[1])
        batch.step()
        if not batch.rows:
            break
    assert not batch.rows
    for rows, want in zip(requests, expected, strict=True):
        for row, completion in zip(rows, want, strict=True):
            _same(row.result, completion)
    assert len(set(widths)) > 1  # columns were trimmed as long rows left


def test_dropped_rows_stop_and_split_batches_merge_back(gen):
    requests = _requests(gen)
    expected = [_alone(gen, rows) for rows in requests]
    batch = RunningBatch(gen)
    batch.admit([row for rows in requests for row in rows])
    batch.step()
    batch.drop(requests[1])  # its client went away
    assert all(row.result is None for row in requests[1])
    assert not any(row in batch.rows for row in requests[1])
    part = batch.take(requests[0])  # decoded on its own for two steps, then merged back
    part.step()
    part.step()
    batch.merge(part)
    assert not part.rows
    while batch.rows:
        batch.step()
    for i in (0, 2, 3):
        for row, completion in zip(requests[i], expected[i], strict=True):
            _same(row.result, completion)
    # The cache is the longest running row's width: prompt plus the tokens generated so far.
    batch.admit(gen.rows(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0)))
    row = batch.rows[0]
    assert batch._mask_BL.shape[1] == len(row.prompt_ids) and batch._mask_BL.all()


def test_a_failed_prefill_leaves_the_running_batch_as_it_was(gen):
    rows = gen.rows(PROMPTS[0], SamplingParams(max_new_tokens=6, temperature=0))
    [expected] = _alone(gen, rows)
    batch = RunningBatch(gen)
    batch.admit(rows)
    poisoned = gen.rows([[1, 2]], SamplingParams(max_new_tokens=3, temperature=0))
    poisoned[0].prompt_ids = [gen.vocab_size + 5]  # fails in the embedding
    with pytest.raises(IndexError):
        batch.admit(poisoned)
    while batch.rows:
        batch.step()
    _same(rows[0].result, expected)


def test_the_kv_cache_goes_by_the_name_the_installed_transformers_takes(gen):
    """transformers renamed the forward's `past_key_values` to `cache` (the old name warns,
    and goes in 5.40): a prefill and a step pass the cache under the name the model takes, so
    nothing warns, and an older release's model still gets `past_key_values`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = RunningBatch(gen)
        batch.admit(gen.rows(PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0)))
        batch.step()
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert cache_keyword(gen.model) in inspect.signature(type(gen.model).forward).parameters

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return SimpleNamespace(past_key_values=("cache", past_key_values))

    assert cache_keyword(Older()) == "past_key_values"
    assert returned_cache(Older()(past_key_values=1)) == ("cache", 1)
    assert returned_cache(SimpleNamespace(cache="new", past_key_values=None)) == "new"


def test_freezing_the_loaded_heap_leaves_later_garbage_collectable():
    """What a replica and its decode process do once loaded (`freeze_loaded_heap`): every
    object alive is frozen, and cycles made afterwards are still collected."""
    import gc
    import weakref

    from hlm_ray.serve.engine import freeze_loaded_heap

    class Node:
        pass

    try:
        frozen = freeze_loaded_heap()
        assert frozen == gc.get_freeze_count() > 1000
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after loading
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


# ----------------------------------------------------------------------------- the decode loop


def _all_same(jobs, expected: list[list]) -> None:
    """Every job finished without error, each row with what it decodes alone."""
    for job, want in zip(jobs, expected, strict=True):
        assert job.error is None
        for row, completion in zip(job.rows, want, strict=True):
            _same(row.result, completion)


def _wait(jobs, timeout: float = 60.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not all(job.done for job in jobs):
        assert time.monotonic() < end, "decode loop did not finish its jobs"
        time.sleep(0.005)


def _engine(kind: str, gen: Generator, model_dir: str):
    """The replica's decode loop on a thread, or in a process of its own (`--decode-process`)."""
    from hlm_ray.serve.decode_process import DecodeProcess
    from hlm_ray.serve.engine import DecodeLoop

    if kind == "thread":
        return DecodeLoop(gen, max_rows=8)
    return DecodeProcess(model_dir, device="cpu", max_rows=8, num_threads=1)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_decode_loop_streams_cancels_and_fails_requests_alone(gen, tiny_decoder_dir, kind):
    """The server's decode loop (`hlm_ray.serve.engine.DecodeLoop`, on the replica's thread
    or in its own process): requests submitted while others decode get what they get alone
    (streamed deltas concatenate to it); a cancelled request leaves the batch at the next
    step; one that cannot be decoded fails alone, with its error's type. Its counters say when
    it was last handed a request and when its busy spell's first step began (the serving
    benchmark's breakdown reads them)."""
    import threading
    import time

    from hlm_ray.generate import Row

    long = SamplingParams(max_new_tokens=60, temperature=1.0)
    requests = _requests(gen)
    expected = [_alone(gen, rows) for rows in requests]
    engine = _engine(kind, gen, tiny_decoder_dir)
    try:
        first_step, seen = threading.Event(), []  # the Unix times its news arrived

        def stamp() -> None:
            seen.append(time.time())
            first_step.set()

        cancelled = engine.submit(gen.rows(PROMPTS[1], long, seed=5), stamp, stream=True)
        assert first_step.wait(30)  # it is decoding: the others join a running batch
        poisoned = [Row([gen.vocab_size + 5], SamplingParams(max_new_tokens=3))]
        # Streamed: a request of 2 rows (n=2: each delta names its choice) and one of 1.
        jobs = [engine.submit(rows, lambda: None, stream=i in (0, 2))
                for i, rows in enumerate(requests)]  # fmt: skip
        bad = engine.submit(poisoned, lambda: None)
        engine.cancel(cancelled)
        _wait([*jobs, bad])
        assert isinstance(bad.error, IndexError)
        _all_same(jobs, expected)
        for i in (0, 2):
            streamed = ["" for _ in jobs[i].rows]
            for deltas in jobs[i].events:
                for d in deltas:
                    streamed[d.index] += d.text
            assert streamed == [c.text for c in expected[i]]
        assert cancelled.rows[0].result is None and not cancelled.done
        assert engine.stats["max_batch_requests"] >= 2
        stats = engine.refresh_stats() if kind == "process" else engine.stats
        # The first step of this busy spell came before the second piece of news (a prefill
        # gives the first, a step at the latest the second), not at a later step.
        assert stats["busy_since"] <= stats["stepping_since"] <= seen[1]
        assert seen[0] <= engine.submitted_at <= time.time()  # the last submission (`bad`)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_forming_batch_prefills_each_request_as_it_arrives_and_steps_once_full(
    gen, tiny_decoder_dir, kind
):
    """With a first-batch wait, an idle decode loop prefills each request as it arrives (while
    the replica still reads the later ones) and holds the first step until the batch is full,
    not until the wait ends; a batch that does not fill steps when the wait ends. Every request
    still gets what it gets alone."""
    import time

    from hlm_ray.serve.decode_process import DecodeProcess
    from hlm_ray.serve.engine import DecodeLoop

    def engine_of(max_rows: int, wait_s: float):
        if kind == "thread":
            loop = DecodeLoop(gen, max_rows=max_rows, wait_s=wait_s)
            return loop, lambda: loop.stats
        child = DecodeProcess(tiny_decoder_dir, device="cpu", max_rows=max_rows, wait_s=wait_s,
                              num_threads=1)  # fmt: skip
        return child, child.refresh_stats

    def prefilled(stats, count: int) -> None:
        deadline = time.monotonic() + 20
        while stats()["batches"] < count:
            assert time.monotonic() < deadline, "a request was not prefilled as it arrived"
            time.sleep(0.01)

    requests = _requests(gen)
    expected = [_alone(gen, rows) for rows in requests]
    wait_s = 60.0  # far beyond the test: only a full batch may start the steps
    engine, stats = engine_of(sum(len(rows) for rows in requests), wait_s)
    try:
        start, jobs = time.monotonic(), []
        for i, rows in enumerate(requests):
            jobs.append(engine.submit(rows, lambda: None))
            prefilled(stats, i + 1)
            if i < len(requests) - 1:
                assert stats()["steps"] == 0  # the batch is not full yet
        _wait(jobs)
        assert time.monotonic() - start < wait_s
        _all_same(jobs, expected)
    finally:
        engine.close()

    engine, stats = engine_of(8, 0.5)  # one request of 1 row: the batch never fills
    try:
        start = time.monotonic()
        job = engine.submit(_requests(gen)[1], lambda: None)  # fresh rows: no results yet
        _wait([job])
        assert time.monotonic() - start >= 0.5  # its first step waited for the end of the wait
        assert stats()["batches"] == 1
        _same(job.rows[0].result, expected[1][0])
    finally:
        engine.close()


def test_a_burst_submitted_on_an_event_loop_crosses_to_the_decode_process_in_groups(
    gen, tiny_decoder_dir, monkeypatch
):
    """Requests submitted in one turn of the replica's event loop reach the decode process in
    messages of FLUSH_EVERY (one write, one wake-up of the child each) and the rest at the
    turn's end, and its answers come back one message per decoding pass; each request still
    gets what it gets alone, and one cancelled before its turn ended is never decoded."""
    import asyncio

    from hlm_ray.serve import decode_process
    from hlm_ray.serve.decode_process import DecodeProcess

    requests = _requests(gen)
    expected = [_alone(gen, rows) for rows in requests]
    engine = DecodeProcess(tiny_decoder_dir, device="cpu", max_rows=8, num_threads=1)
    sent: list[str] = []
    send = engine._conn.send
    engine._conn.send = lambda message: (
        sent.append(f"{message[0]} {len(message[1])}" if message[0] == "submit" else message[0]),
        send(message),
    )[1]
    monkeypatch.setattr(decode_process, "FLUSH_EVERY", 3)  # 3 at once, then 1 + the dropped one
    try:

        async def burst():
            loop = asyncio.get_running_loop()
            events = [asyncio.Event() for _ in requests]
            jobs = [engine.submit(rows, lambda e=e: loop.call_soon_threadsafe(e.set))
                    for rows, e in zip(requests, events, strict=True)]  # fmt: skip
            dropped = engine.submit(
                gen.rows(PROMPTS[0], SamplingParams(max_new_tokens=40)), lambda: None
            )
            engine.cancel(dropped)  # before the loop's turn ended
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            return jobs, dropped

        jobs, dropped = asyncio.run(burst())
        assert [m for m in sent if m.startswith("submit")] == ["submit 3", "submit 2"], sent
        _all_same(jobs, expected)
        assert dropped.rows[0].result is None and not dropped.done
        # Each kept row decodes at most one step per token it gave; the dropped row none of 40.
        tokens = sum(c.completion_tokens for want in expected for c in want)
        assert engine.refresh_stats()["decoded_rows"] <= tokens
    finally:
        engine.close()


def test_a_decode_process_that_dies_fails_its_requests_and_says_so(tiny_decoder_dir):
    """A decode process killed mid-request (out of memory, a crash): the requests in flight
    and those that follow fail at once with the reason, and the replica's health check sees
    it (Serve then replaces the replica)."""
    import os
    import signal

    from hlm_ray.serve.decode_process import DecodeProcess

    engine = DecodeProcess(tiny_decoder_dir, device="cpu", max_rows=8, num_threads=1)
    # Once loaded, the child froze its heap (torch, transformers, the model): no full
    # collection rescans it while requests wait.
    assert engine.frozen_objects > 50_000
    gen_rows = Generator.load(tiny_decoder_dir).rows
    try:
        started = __import__("threading").Event()
        long = SamplingParams(max_new_tokens=100, temperature=1.0)
        job = engine.submit(gen_rows(PROMPTS[0], long, seed=1), started.set, stream=True)
        assert started.wait(30) and engine.refresh_stats()["steps"] >= 1
        os.kill(engine._proc.pid, signal.SIGKILL)
        _wait([job])
        assert "decode process exited" in str(job.error) and not engine.alive
        late = engine.submit(gen_rows(PROMPTS[1], long, seed=2), lambda: None)
        _wait([late])
        assert "decode process" in str(late.error)
    finally:
        engine.close()


def test_a_decode_process_whose_replica_dies_exits_too(tiny_decoder_dir, tmp_path):
    """The child reads its pipe on its decode thread and waits on it when idle: a replica
    killed outright (SIGKILL: no "stop" message) closes the pipe, and the child exits instead
    of living on as an orphan that holds the model."""
    import os
    import signal
    import subprocess
    import sys
    import time

    replica = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from hlm_ray.serve.decode_process import DecodeProcess\n"
            "engine = DecodeProcess(sys.argv[1], device='cpu', max_rows=8, num_threads=1)\n"
            "print(engine._proc.pid, flush=True)\n"
            "time.sleep(600)\n"
        ), tiny_decoder_dir],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    child = 0
    try:
        child = int(replica.stdout.readline())
        assert _running(child)
        os.kill(replica.pid, signal.SIGKILL)
        replica.wait(10)
        end = time.monotonic() + 20
        while _running(child):
            assert time.monotonic() < end, "the decode process outlived its replica"
            time.sleep(0.05)
    finally:
        replica.kill()
        if child and _running(child):
            os.kill(child, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit may wait for a reaper)."""
    from hlm_ray.bench.serve import stat_fields

    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def test_a_failed_step_leaves_the_batch_as_it_was(gen):
    """A step that fails (here a row's logit_bias names a token past the vocabulary) leaves the
    cache, mask and positions as they were: once the row that fails is dropped, the others go
    on and decode what they decode alone."""
    requests = _requests(gen)[:2]
    expected = [_alone(gen, rows) for rows in requests]
    poisoned = gen.rows(PROMPTS[3], SamplingParams(max_new_tokens=9, temperature=0))
    batch = RunningBatch(gen)
    batch.admit([*requests[0], *poisoned, *requests[1]])
    batch.step()
    width = batch._mask_BL.shape[1]
    poisoned[0].params = SamplingParams(max_new_tokens=9, logit_bias=((gen.vocab_size + 5, 1.0),))
    with pytest.raises(IndexError):
        batch.step()
    assert batch._mask_BL.shape[1] == width
    assert {layer.keys.shape[2] for layer in batch._past.layers} == {width}
    batch.drop(poisoned)
    while batch.rows:
        batch.step()
    for rows, want in zip(requests, expected, strict=True):
        for row, completion in zip(rows, want, strict=True):
            _same(row.result, completion)


def test_decode_loop_fails_a_request_whose_step_fails_and_the_others_go_on(gen):
    """When a step of the shared batch fails, each request steps alone: the one that fails
    gets the error, its batch-mates finish with the text they get alone."""
    from hlm_ray.serve.engine import DecodeLoop

    requests = _requests(gen)[:2]
    expected = [_alone(gen, rows) for rows in requests]
    bad_params = SamplingParams(max_new_tokens=40, logit_bias=((gen.vocab_size + 5, 1.0),))
    victim = gen.rows(PROMPTS[3], SamplingParams(max_new_tokens=40, temperature=0))

    def poison() -> None:  # runs on the decode thread, between steps
        victim[0].params = bad_params

    engine = DecodeLoop(gen, max_rows=8)
    try:
        jobs = [engine.submit(rows, lambda: None) for rows in requests]
        bad = engine.submit(victim, poison, stream=True)
        _wait([*jobs, bad])
        assert isinstance(bad.error, IndexError) and bad.events  # it had decoded some text
        _all_same(jobs, expected)
    finally:
        engine.close()
