"""`hlm data prepare` and `hlm data bench`: thin over `hlm_ray.prepare`.

    hlm data prepare --preset tiny-decoder --set data.sources=[DIR] --output OUT
    hlm data prepare --preset tiny-decoder --set data.sources=[openwebtext] --workers 16
    hlm data prepare --set tokenizer.kind=file --set tokenizer.path=tokenizers/gpt2 --output s3://b/x
    hlm data bench --size-mb 300                  # prep throughput, Ray Data overhead, train RSS
    hlm data count --model runs/tiny-headless     # token_counts.npz + readout.json beside a model

Without --output the folder goes to the cache (HLM_CACHE_DIR/prepared/<settings key>), where
training finds it from `data.sources` alone.
"""

from __future__ import annotations

import argparse

from hlm_ray.commands.common import config_args

HELP = "prepare a corpus (tokenizer, token shards, manifest) once, for training to read"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help=HELP, description=HELP)
    sub = p.add_subparsers(dest="data_command", required=True)
    prep = sub.add_parser(
        "prepare",
        help="tokenize sources into a prepared folder",
        description="Tokenize the config's data sources on Ray Data into a prepared folder of "
        "token shards with a manifest (resumable); train on it with --set data.prepared=URI.",
    )
    config_args(prep, objective=False, example="data.sources=[DIR]")
    prep.add_argument("--output", help="folder or pyarrow URI (default: the cache)")
    prep.add_argument(
        "--workers",
        type=int,
        default=None,
        help="Ray Data tokenizing tasks at a time, one CPU each (default: every CPU of the Ray "
        "cluster; 0: in process)",
    )
    prep.add_argument(
        "--piece-mb", type=float, default=8.0, help="MB of text per unit of work (default 8)"
    )
    prep.add_argument("--address", help="Ray cluster to join (default: a local one)")
    bench = sub.add_parser(
        "bench",
        help="data preparation and memory-mapped reading benchmark",
        description="Prepare a synthetic corpus and read it back memory-mapped: throughput of "
        "both, and the training process's memory (RSS).",
    )
    bench.add_argument("--size-mb", type=int, default=300, help="synthetic corpus size")
    bench.add_argument("--workdir", default="/tmp/hlm_data_bench", help="corpora and outputs")
    bench.add_argument("--output", default="runs/bench/data", help="results (JSON, Markdown)")
    bench.add_argument("--skip-rss", action="store_true", help="skip the training RSS part")
    count = sub.add_parser(
        "count",
        help="count a model's training tokens (its unigram prior) from its prepared corpus",
        description="Count the tokens of the prepared training split a model was trained on "
        "and write token_counts.npz beside it, with readout.json (a decoder's prior readout, "
        "fitted on the validation split): for a model trained before runs counted their "
        "tokens, or moved without the file (docs/readout.md).",
    )
    count.add_argument("--model", required=True, help="run, checkpoint or model folder")
    count.add_argument(
        "--force", action="store_true", help="replace the counts the model already has"
    )
    return p


def run(args: argparse.Namespace) -> int:
    if args.data_command == "count":
        return _count(args)
    if args.data_command == "bench":
        from hlm_ray.prepare.bench import run_bench

        return run_bench(args)
    from hlm_ray.prepare import PrepareRequest, prepare
    from hlm_ray.presets import load_config

    cfg = load_config(args.preset or "tiny-decoder", yaml_file=args.config, overrides=args.set)
    workers = args.workers
    if workers != 0:
        import os

        import ray

        if not ray.is_initialized():
            os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
            ray.init(address=args.address, log_to_driver=False, include_dashboard=False)
    from dataclasses import replace

    request = replace(PrepareRequest.from_config(cfg), piece_bytes=int(args.piece_mb * 2**20))
    prepared = prepare(request, args.output, workers=workers)
    print(f"prepared: {prepared.uri}  (fingerprint {prepared.fingerprint[:16]})")
    print(f"train with: --set data.prepared={prepared.uri}")
    return 0


def _count(args: argparse.Namespace) -> int:
    from hlm_ray.train.token_counts import count_model

    out = count_model(args.model, force=args.force)
    print(f"counted {out['tokens']:,} tokens of {out['prepared'].uri}: {out['path']}")
    record = out["record"]
    if record and record.get("prior"):
        fit = record["prior"].get("fit") or {}
        nats = ", ".join(f"{k} {v:.4f}" for k, v in fit.get("nats", {}).items())
        print(
            "readout.json: prior readout (scale 1, weight 1, derived); fitted on the validation "
            f"split: scale {fit.get('scale', 1.0):.4g}, weight {fit.get('prior_weight', 1.0):.4g} "
            f"(nats per token: {nats or 'not measured'})"
        )
    elif record:
        print(f"readout.json: {record['readout']} (add-{record['alpha']:.3g} smoothing)")
    return 0
