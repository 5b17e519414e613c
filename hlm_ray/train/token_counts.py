"""The target tokens a run trained on, counted while it trains, and what is saved from them.

    step_V = torch.zeros_like(run.target_counts)
    count_targets_(step_V, input_ids_BL, labels_BL)   # every micro-batch, on the device
    run.target_counts += step_V                       # once the step's update is applied
    total_V = total_counts(run)                       # every rank, at a checkpoint: summed
    write_model_files(model_dir, run, total_V, final) # token_counts.npz (+ readout.json)
    log_q_V = corpus_log_prior(cfg)                   # init.prior_bias: before any step

Cost: one scatter-add of the micro-batch's K target ids into a (V,) int64 vector on the
device, no host sync (`torch.bincount` would sync to size its output); the ranks' vectors are
summed only when a checkpoint is saved. Exact under resume: the sum so far is saved in the
checkpoint's train state and restored on rank 0 alone (every other rank starts again from
zero), so the next sum over ranks continues it, whatever the number of workers. A step whose
update `optim.on_nonfinite=skip` dropped was not trained on and is not counted. A run resumed
from a checkpoint written before counting existed has no count for its earlier steps: it saves
none (`hlm data count` counts the corpus instead).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hlm_ray.unigram import COUNTS_FILE, Unigram, count_split, save_counts

STATE_KEY = "target_counts"
"""The (V,) int64 counts in a checkpoint's train state (train_state.pt)."""
WHAT = "target tokens trained on"


def count_targets_(counts_V: torch.Tensor, input_ids_BL, labels_BL) -> None:
    """Add the micro-batch's target ids to `counts_V` in place: a decoder's next tokens
    input[:, 1:], an encoder's masked originals (labels ≠ -100)."""
    if labels_BL is None:
        ids = input_ids_BL[:, 1:].reshape(-1)
        counts_V.scatter_add_(0, ids, torch.ones_like(ids))
    else:
        labels = labels_BL.reshape(-1)
        keep = (labels != -100).to(counts_V.dtype)
        counts_V.scatter_add_(0, labels.clamp_min(0), keep)


def total_counts(run) -> np.ndarray | None:
    """The counts of every rank summed (a collective: every rank calls it at a checkpoint);
    None when they are not exact (resumed from a checkpoint without counts)."""
    if run.target_counts is None:
        return None
    total = run.target_counts.clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return None if run.counts_unknown else total.cpu().numpy()


def restore_counts(run, state: dict) -> None:
    """After a resume: rank 0 continues the checkpoint's sum, other ranks start from zero."""
    saved = state.get(STATE_KEY)
    if saved is None:
        run.counts_unknown = run.start > 0
        return
    if run.env.is_main:
        run.target_counts.copy_(torch.as_tensor(saved).to(run.target_counts.device))


def write_model_files(model_dir: Path, run, counts_V: np.ndarray | None, final: bool) -> None:
    """token_counts.npz in a checkpoint's model folder (when the counts are exact); at the
    final step of a decoder run, its readout.json too (`hlm_ray.readout_fit`)."""
    if counts_V is None:
        return
    cfg = run.cfg
    save_counts(
        model_dir / COUNTS_FILE,
        counts_V,
        what=WHAT,
        source="training",
        objective=cfg.objective.name,
        steps=run.done,
        workers=run.env.world_size,
        data=cfg.data.prepared or ",".join(cfg.data.sources),
    )
    if final and cfg.model.family == "decoder":
        write_readout(model_dir, run.model, counts_V, cfg)


def write_readout(model_dir: Path, model, counts_V, cfg, *, prepared=None) -> dict:
    """readout.json for a decoder trained with `cfg` (`hlm_ray.readout_fit.readout_record`),
    fitted on the validation split of its prepared corpus."""
    from hlm_ray.readout import write_record
    from hlm_ray.readout_fit import readout_record
    from hlm_ray.train.inputs import build_prepared

    prepared = prepared or build_prepared(cfg, progress=False)
    val_counts = count_split(prepared, "val", seq_len=cfg.data.seq_len)
    val_blocks = _val_blocks(prepared, cfg)
    record = readout_record(
        model, counts_V, val_counts, val_blocks, temperature=cfg.objective.temperature
    )
    write_record(model_dir, record)
    return record


def _val_blocks(prepared, cfg):
    from hlm_ray.prepare import TokenBlocks

    return TokenBlocks.open(prepared, "val", seq_len=cfg.data.seq_len)


def corpus_log_prior(cfg) -> np.ndarray:
    """log q (V,) of the run's training split (what `TokenBlocks` serves it), add-alpha fitted
    on its validation split: the start of `init.prior_bias`'s head bias."""
    from hlm_ray.train.inputs import build_prepared

    prepared = build_prepared(cfg, progress=False)
    seq_len = cfg.data.seq_len
    train = count_split(prepared, "train", seq_len=seq_len, max_tokens=cfg.data.max_tokens)
    val = count_split(prepared, "val", seq_len=seq_len)
    return Unigram.fit(train, val).log_probs()


def count_model(model_ref, *, force: bool = False) -> dict:
    """`hlm data count --model RUN`: the counts of a model trained before counting existed (or
    moved without them), from its prepared training corpus, written beside it with its
    readout.json. {"path", "tokens", "record" (readout.json, decoders), "prepared"}."""
    from hlm_ray.errors import HLMError
    from hlm_ray.pretrained import REGISTRY_SCHEME, resolve_model_dir
    from hlm_ray.train.checkpoint import MARKER
    from hlm_ray.train.resume import LAUNCH_FILE
    from hlm_ray.train.run_lock import LOCK_FILE, acquire

    if str(model_ref).startswith(REGISTRY_SCHEME):
        raise HLMError(
            f"{model_ref} is a registered copy: count the run folder it was registered from "
            "(`hlm data count --model RUN`) and register that again"
        )
    folder = resolve_model_dir(model_ref)
    path = folder / COUNTS_FILE
    if path.is_file() and not force:
        raise HLMError(
            f"{path} exists already (a run counts the tokens it trains on, exactly); pass "
            "--force to replace it with the counts of the whole training split"
        )
    holder = folder.parent
    if (holder / MARKER).is_file():  # resume checks every file of a checkpoint against it
        raise HLMError(
            f"{holder} is a checkpoint: its files are checked against its manifest when the run "
            f"resumes, so new counts would make it damaged; count the run's model (--model "
            f"{holder.parent}), or a copy of {folder} made outside the run folder"
        )
    run = {holder / name for name in (LOCK_FILE, LAUNCH_FILE)}
    release = (
        acquire(holder, fix="wait for the run to end (its model then has its counts) or stop it")
        if any(p.is_file() for p in run)
        else lambda: None
    )  # a run folder has one writer at a time: this count is one while it writes
    try:
        return _count_into(folder, path)
    finally:
        release()


def _count_into(folder: Path, path: Path) -> dict:
    """The counting and writing of `count_model`, with the run folder's lock held."""
    from hlm_ray.errors import HLMError
    from hlm_ray.pretrained import load_pretrained, run_config_of
    from hlm_ray.train.inputs import build_prepared

    cfg = run_config_of(folder)
    if cfg is None:
        raise HLMError(
            f"{folder} has no config.yaml beside it, so its training corpus is unknown; pass "
            "the run folder it was saved in"
        )
    prepared = build_prepared(cfg, progress=True)
    framed = cfg.model.family == "encoder"  # [CLS] ... [SEP] around seq_len - 2 tokens
    seq_len = cfg.data.seq_len - 2 if framed else cfg.data.seq_len
    counts = count_split(prepared, "train", seq_len=seq_len, max_tokens=cfg.data.max_tokens)
    save_counts(
        path,
        counts,
        what="tokens of the prepared training split",
        source="corpus",
        objective=cfg.objective.name,
        data=cfg.data.prepared or ",".join(cfg.data.sources),
        fingerprint=prepared.fingerprint,
    )
    record = None
    if not framed:
        pre = load_pretrained(folder, kind="causal_lm")
        record = write_readout(folder, pre.model, counts, cfg, prepared=prepared)
    if record is not None and record["readout"] == "prior":
        from hlm_ray.model_card import write_model_card

        write_model_card(folder)  # a raw headless decoder: its card now says it has a prior
    return {"path": path, "tokens": int(counts.sum()), "record": record, "prepared": prepared}
