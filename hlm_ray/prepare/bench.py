"""`hlm data bench`: preparation throughput on Ray Data and the memory of training from shards.

    hlm data bench --size-mb 300 --workdir /tmp/hlm_data_bench --output runs/bench/data

On a synthetic corpus (the shared corpus/en paragraphs shuffled and repeated into files of
8 MB under --workdir; never committed) it measures, in one run:
  - tokenization throughput of `prepare` with 1 and with 2 Ray Data workers (target ratio ≥ 1.7);
  - the same against raw `tokenizers` `encode_batch` of one process over the same documents
    with every CPU (target ≥ 0.7: Ray Data's overhead stays small);
  - peak RSS of `hlm train --local` reading a prepared folder of the full corpus against one
    100× smaller (target ≤ 1.1);
  - what checking the shards against the manifest costs (`prepare.verify`): the first open on a
    machine, which reads every shard, and later ones.
The figures go to <output>/data_bench.json and .md (docs/benchmarks.md quotes them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from hlm_ray.paths import data_dir

FILE_BYTES = 8 << 20


def synthetic_corpus(folder: Path, size_mb: float, seed: int = 0) -> Path:
    """Shuffled paragraphs of the shared English corpus, repeated to `size_mb`, 8 MB files."""
    from hlm_ray.prepare.sources import make_pieces, read_documents, resolve_sources

    target = int(size_mb * 1e6)
    done = folder / f"DONE-{target}"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("part-*.txt"):
        old.unlink()
    pieces = make_pieces(resolve_sources([str(data_dir() / "corpus/en")]), piece_bytes=1 << 40)
    paras = [d for p in pieces for d in read_documents(p, text_field="text", invalid_utf8="refuse")]
    rng = np.random.default_rng(seed)
    written, part, buf, size = 0, 0, [], 0
    while written < target:
        for i in rng.permutation(len(paras)):
            text = paras[i] + "\n\n"
            buf.append(text)
            size += len(text.encode())
            if size >= FILE_BYTES or written + size >= target:
                (folder / f"part-{part:05d}.txt").write_text("".join(buf))
                written, part, buf, size = written + size, part + 1, [], 0
                if written >= target:
                    break
    done.write_text("ok\n")
    return folder


def _raw_encode(prepared, corpus: Path) -> dict:
    """One process, every CPU (the tokenizers thread pool): documents in memory -> ids."""
    from tokenizers import Tokenizer

    from hlm_ray.prepare.sources import make_pieces, read_documents, resolve_sources

    tok = Tokenizer.from_file(str(prepared.path / "tokenizer" / "tokenizer.json"))
    pieces = make_pieces(resolve_sources([str(corpus)]), piece_bytes=1 << 40)
    docs = [d for p in pieces for d in read_documents(p, text_field="text", invalid_utf8="refuse")]
    nbytes = sum(len(d.encode()) for d in docs)
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(docs), 1024):
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(docs[i : i + 1024]))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "text_bytes": nbytes,
        "tokens": tokens,
        "mb_per_s": nbytes / seconds / 1e6,
    }


def _peak_rss_mb(prepared: Path, out: Path, steps: int = 5) -> float:
    """Peak RSS of `hlm train --local` (a child process) reading `prepared`."""
    cmd = [sys.executable, "-m", "hlm_ray.cli", "train", "--preset", "tiny-decoder",
           "--objective", "headless", "--local", "--output", str(out),
           "--set", f"data.prepared={prepared}", "--set", f"optim.max_steps={steps}"]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out.parent}/mlflow.db"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"training failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024


def _shard_check(folder: Path) -> dict:
    """What checking a prepared folder's shards costs training (`prepare.verify`): the first
    open on this machine (one read of every shard: sha256 and largest id) and a later one (the
    cached verdicts), in a cache of its own. The shards were just written: the page cache holds
    them, so a first check after a reboot adds the disk's read time."""
    import tempfile

    from hlm_ray.paths import CACHE_ENV
    from hlm_ray.prepare import verify

    manifest = json.loads((folder / "manifest.json").read_text())
    nbytes = sum(p.stat().st_size for p in folder.glob("*.bin"))
    saved = os.environ.get(CACHE_ENV)
    out = {"shard_bytes": nbytes, "shards": len(list(folder.glob("*.bin")))}
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache
        try:
            for when in ("first", "cached"):
                verify._seen.clear()  # a new process: only the cache on disk is kept
                start = time.perf_counter()
                verify.check_shards(folder, manifest)
                out[f"{when}_s"] = time.perf_counter() - start
        finally:
            if saved is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = saved
    out["first_mb_per_s"] = nbytes / out["first_s"] / 1e6
    return out


def run_bench(args) -> int:
    import shutil

    import ray

    from hlm_ray.prepare import PrepareRequest, prepare
    from hlm_ray.presets import load_config

    work = Path(args.workdir)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(
        f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs"
    )
    big = synthetic_corpus(work / "corpus", args.size_mb)
    small = synthetic_corpus(work / "corpus_small", args.size_mb / 100, seed=1)
    cfg = load_config("tiny-decoder", overrides=[f"data.sources=[{big}]"])
    request = replace(PrepareRequest.from_config(cfg), train_sample_bytes=20_000_000)
    results: dict = {"size_mb": args.size_mb, "load_before": load, "cpus": os.cpu_count()}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for workers in (1, 2):
            folder = work / f"prepared-{workers}"
            shutil.rmtree(folder, ignore_errors=True)
            prepared = prepare(request, folder, workers=workers)
            t = prepared.manifest["timings"]
            results[f"workers_{workers}"] = {
                **t,
                "mb_per_s": t["text_bytes"] / t["tokenize_s"] / 1e6,
            }
    finally:
        ray.shutdown()
    results["raw_encode_batch"] = _raw_encode(prepared, big)
    results["shard_check"] = _shard_check(work / "prepared-2")
    w1, w2 = results["workers_1"]["mb_per_s"], results["workers_2"]["mb_per_s"]
    results["ratio_2_vs_1"] = w2 / w1
    results["ratio_vs_raw"] = w2 / results["raw_encode_batch"]["mb_per_s"]
    if not args.skip_rss:
        small_folder = work / "prepared-small"
        shutil.rmtree(small_folder, ignore_errors=True)
        small_req = replace(request, sources=(str(small),), train_sample_bytes=None)
        prepare(small_req, small_folder, workers=0)
        rss_small = _peak_rss_mb(small_folder, work / "run-small")
        rss_big = _peak_rss_mb(work / "prepared-2", work / "run-big")
        results.update(rss_small_mb=rss_small, rss_big_mb=rss_big, ratio_rss=rss_big / rss_small)
    results["load_after"] = os.getloadavg()
    (out_dir / "data_bench.json").write_text(json.dumps(results, indent=1))
    md = _markdown(results)
    (out_dir / "data_bench.md").write_text(md)
    print(md)
    return 0


def _markdown(r: dict) -> str:
    rows = [
        "| measure | value | target |",
        "|---|---|---|",
        f"| prepare, 1 Ray Data worker | {r['workers_1']['mb_per_s']:.2f} MB/s | |",
        f"| prepare, 2 Ray Data workers | {r['workers_2']['mb_per_s']:.2f} MB/s | |",
        f"| raw encode_batch, one process, all CPUs | {r['raw_encode_batch']['mb_per_s']:.2f} MB/s | |",
        f"| 2 workers / 1 worker | {r['ratio_2_vs_1']:.2f}× | ≥ 1.7× |",
        f"| 2 workers / raw encode_batch | {r['ratio_vs_raw']:.2f}× | ≥ 0.7× |",
    ]
    check = r.get("shard_check")
    if check:
        mb = check["shard_bytes"] / 1e6
        rows += [
            f"| shard check, first open on this machine ({mb:.0f} MB of shards) | "
            f"{check['first_s']:.2f} s ({check['first_mb_per_s']:.0f} MB/s) | |",
            f"| shard check, every later open (cached) | {check['cached_s'] * 1e3:.1f} ms | |",
        ]
    if "ratio_rss" in r:
        rows += [
            f"| training peak RSS, {r['size_mb'] / 100:g} MB corpus | {r['rss_small_mb']:.0f} MB | |",
            f"| training peak RSS, {r['size_mb']:g} MB corpus | {r['rss_big_mb']:.0f} MB | |",
            f"| RSS ratio (100× corpus) | {r['ratio_rss']:.3f}× | ≤ 1.1× |",
        ]
    load = ", ".join(f"{x:.2f}" for x in r["load_before"])
    after = ", ".join(f"{x:.2f}" for x in r["load_after"])
    return (
        f"Synthetic corpus: {r['size_mb']} MB; {r['cpus']} CPUs; load average before "
        f"{load}, after {after}.\n\n" + "\n".join(rows) + "\n"
    )
