"""The checks that span a config's fields: one clear line naming the field, its value and what
is allowed, before any work starts.

    validate(cfg)    # returns cfg unchanged, or raises HLMError("optim.lr=0 is not allowed; ...")

`Config.from_dict` (and so every preset, YAML file and override) runs it; the type of each value
is checked earlier, when it is parsed (`hlm_ray.config.parse`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from hlm_ray.errors import HLMError

C = TypeVar("C")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise HLMError(f"{name}={value!r} is not allowed; {allowed}")


def validate(cfg: C) -> C:
    """Checks that span fields of a `Config`; returns `cfg` unchanged or raises a one-line
    HLMError."""
    m, t, d, o, p, r = cfg.model, cfg.tokenizer, cfg.data, cfg.objective, cfg.optim, cfg.run
    for name in ("hidden_size", "num_layers", "num_heads", "max_positions"):
        _check(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be > 0")
    _check(
        m.hidden_size % m.num_heads == 0,
        "model.num_heads",
        m.num_heads,
        f"must divide model.hidden_size={m.hidden_size}",
    )
    _check(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")
    _check(t.kind != "file" or bool(t.path), "tokenizer.path", t.path, "required when kind=file")
    _check(t.vocab_size > 0, "tokenizer.vocab_size", t.vocab_size, "must be > 0")
    _check(bool(d.sources), "data.sources", d.sources, "give at least one corpus")
    _check(d.seq_len >= 2, "data.seq_len", d.seq_len, "must be >= 2")
    _check(
        d.seq_len <= m.max_positions,
        "data.seq_len",
        d.seq_len,
        f"must not exceed model.max_positions={m.max_positions}; lower the sequence length "
        "or raise model.max_positions",
    )
    _check(d.shard_tokens > 0, "data.shard_tokens", d.shard_tokens, "must be > 0")
    _check(
        t.train_sample_bytes is None or t.train_sample_bytes > 0,
        "tokenizer.train_sample_bytes",
        t.train_sample_bytes,
        "must be > 0 (or none for all the training text)",
    )
    _check(0 < d.val_fraction < 0.5, "data.val_fraction", d.val_fraction, "must be in (0, 0.5)")
    _check(0 < d.mlm_probability < 1, "data.mlm_probability", d.mlm_probability, "in (0, 1)")
    _check(o.temperature > 0, "objective.temperature", o.temperature, "must be > 0")
    n = o.num_negatives
    _check(n is None or n >= 1, "objective.num_negatives", n, "must be >= 1 (or null: all)")
    _check(
        n is None or not (o.cross_worker_negatives or o.cwt_variant == "mask_same"),
        "objective.num_negatives",
        n,
        "samples the worker's own targets: not with cross_worker_negatives or mask_same",
    )
    _check(p.lr > 0, "optim.lr", p.lr, "must be > 0")
    _check(p.max_steps > 0, "optim.max_steps", p.max_steps, "must be > 0")
    _check(p.warmup_steps >= 0, "optim.warmup_steps", p.warmup_steps, "must be >= 0")
    _check(p.micro_batch_size > 0, "optim.micro_batch_size", p.micro_batch_size, "must be > 0")
    p.grad_accum_steps(world_size=1)
    _check(p.max_skipped_steps >= 1, "optim.max_skipped_steps", p.max_skipped_steps, "must be >= 1")
    _check(
        p.embedding_update == "dense" or o.name == "headless" or m.arch == "gpt_neox",
        "optim.embedding_update",
        p.embedding_update,
        "lazy needs an input embedding no vocabulary head reads: the headless objective, or "
        "arch gpt_neox (untied head); use dense",
    )
    _check(
        not cfg.init.prior_bias or (m.family == "decoder" and o.name != "headless"),
        "init.prior_bias",
        cfg.init.prior_bias,
        "gives a decoder's vocabulary head a bias: objective vanilla or mixed, a decoder arch "
        "(a headless decoder gets the prior as its readout: docs/readout.md)",
    )
    for name in ("log_every", "eval_every", "checkpoint_every", "eval_batches"):
        _check(getattr(r, name) > 0, f"run.{name}", getattr(r, name), "must be > 0")
    _check(r.keep_checkpoints >= 1, "run.keep_checkpoints", r.keep_checkpoints, "must be >= 1")
    _check(r.device in ("auto", "cpu", "cuda"), "run.device", r.device, "auto | cpu | cuda")
    _check_budget(cfg.budget)
    i = cfg.init
    _check(
        not (i.new_head or i.train == "head") or bool(i.model_dir),
        "init.model_dir",
        i.model_dir,
        "required with init.new_head or init.train=head",
    )
    _check(
        i.train == "all" or i.new_head,
        "init.train",
        i.train,
        "head needs init.new_head=true (only a new head can be probed)",
    )
    return cfg


def _check_budget(b: Any) -> None:
    """budget.*: at most one budget, each > 0; unique_columns only with flops."""
    given = [k for k in ("tokens", "flops", "seconds") if getattr(b, k) is not None]
    _check(
        len(given) <= 1,
        f"budget.{given[-1] if given else 'tokens'}",
        getattr(b, given[-1]) if given else None,
        f"give one budget, not {' and '.join('budget.' + k for k in given)}",
    )
    for name in given:
        _check(getattr(b, name) > 0, f"budget.{name}", getattr(b, name), "must be > 0")
    u = b.unique_columns
    _check(u is None or u >= 1, "budget.unique_columns", u, "must be >= 1 (or null: measured)")
    _check(
        u is None or b.flops is not None,
        "budget.unique_columns",
        u,
        "only applies with budget.flops",
    )
    w = b.warmup_share
    _check(w is None or 0 < w < 1, "budget.warmup_share", w, "must be between 0 and 1")
