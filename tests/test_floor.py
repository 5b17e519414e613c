"""The unigram floor under a decoder's scores (hlm_ray.evaluate.floor), as plain functions on a
hand-made prepared folder: the model is the training split's counts with alpha fitted on the
validation split (never the other way round), cached by the folder's fingerprint."""

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hlm_ray.evaluate import floor as floor_mod
from hlm_ray.prepare.request import Prepared
from hlm_ray.unigram import COUNTS_FILE, Unigram, count_split, save_counts


def _prepared(tmp_path, shards, vocab_size):
    splits = {}
    for split, parts in shards.items():
        entries = []
        for i, tokens in enumerate(parts):
            name = f"{split}-{i:05d}.bin"
            np.asarray(tokens, dtype=np.uint16).tofile(tmp_path / name)
            entries.append({"name": name, "num_tokens": len(tokens)})
        splits[split] = {"shards": entries}
    manifest = {"dtype": "uint16", "tokenizer": {"vocab_size": vocab_size}, "splits": splits}
    return Prepared(str(tmp_path), {**manifest, "fingerprint": "f" * 64})


def test_the_floor_is_the_training_splits_counts_with_alpha_fitted_on_validation(tmp_path):
    """A swapped fit (the validation counts as the model, alpha chosen on the training
    counts) passed every test before."""
    train = [[5] * 30 + [1, 2, 3, 4, 6, 7] + [5] * 4]  # 40 tokens, mostly 5
    val = [[5, 5, 5, 5, 5, 5, 1, 2]]
    prepared = _prepared(tmp_path, {"train": train, "val": val}, 10)
    cfg = SimpleNamespace(data=SimpleNamespace(seq_len=4, max_tokens=36))
    floor = floor_mod._from_prepared(prepared, cfg)
    want_train = count_split(prepared, "train", seq_len=4, max_tokens=36)
    want_val = count_split(prepared, "val", seq_len=4)
    assert floor.model.counts.tolist() == want_train.tolist() and int(want_train.sum()) == 36
    fitted = Unigram.fit(want_train, want_val)
    assert floor.model.alpha == fitted.alpha != Unigram.fit(want_val, want_train).alpha
    assert floor.model.alpha_source == fitted.alpha_source
    assert floor.source == f"the training split of {tmp_path} (36 tokens)"


def test_split_counts_are_cached_by_fingerprint_and_counted_again_when_damaged(
    tmp_path, monkeypatch
):
    from hlm_ray.paths import cache_dir

    prepared = _prepared(tmp_path, {"train": [[1, 2, 3, 3, 3, 4]], "val": [[0, 0]]}, 5)
    first = floor_mod.cached_counts(prepared, "train", 3, None)
    assert first.tolist() == [0, 1, 1, 3, 1]
    path = cache_dir("counts") / f"{'f' * 24}-train-3-all.npz"
    assert path.is_file()
    assert floor_mod.cached_counts(prepared, "train", 3, 5).tolist() == [0, 1, 1, 1, 0]
    assert (cache_dir("counts") / f"{'f' * 24}-train-3-5.npz").is_file()

    def no_count(*args, **kwargs):
        raise AssertionError("counted again")

    monkeypatch.setattr("hlm_ray.unigram.count_split", no_count)
    assert floor_mod.cached_counts(prepared, "train", 3, None).tolist() == first.tolist()
    monkeypatch.undo()
    path.write_bytes(b"damaged")
    assert floor_mod.cached_counts(prepared, "train", 3, None).tolist() == first.tolist()


def test_without_a_prepared_folder_the_counts_beside_the_model_are_the_floor(tmp_path):
    pre = SimpleNamespace(run_config=None, path=tmp_path)
    assert floor_mod.run_floor(pre) is None
    assert floor_mod.floor_missing(pre) == (
        f"no training config and no {COUNTS_FILE} beside the model"
    )
    save_counts(tmp_path / COUNTS_FILE, [3, 0, 1000, 2])
    floor = floor_mod.run_floor(pre)
    assert floor.model.counts.tolist() == [3, 0, 1000, 2] and floor.model.alpha == 0.5
    assert floor.source == f"{COUNTS_FILE} beside the model (1,005 tokens)"
    with_cfg = SimpleNamespace(run_config=object(), path=tmp_path)
    assert floor_mod.floor_missing(with_cfg) == (
        f"its prepared training corpus is not on this machine and there is no {COUNTS_FILE}"
    )


def test_lambada_perplexity_of_the_floor_ignores_the_context(monkeypatch):
    import hlm_ray.evaluate.lambada as lambada

    monkeypatch.setattr(lambada, "encode_pair", lambda tok, c, w: ([9, 9], [len(w), 1]))
    model = Unigram(np.array([1, 1, 2, 4]), 0.5, "")
    log_q = model.log_probs()
    examples = [{"context": "x", "continuation": "ab"}, {"context": "y", "continuation": "abc"}]
    out = floor_mod.Floor(model, "").lambada_perplexity(None, examples)
    mean = (log_q[2] + log_q[1] + log_q[3] + log_q[1]) / 2
    assert out == {floor_mod.PPL_FLOOR: pytest.approx(math.exp(-mean), rel=1e-12)}
    # A continuation whose -log q sums past 709 (exp overflows): inf, not an OverflowError.
    tiny = Unigram(np.array([10**15, 1, 1, 1]), 1e-3, "")
    monkeypatch.setattr(lambada, "encode_pair", lambda tok, c, w: ([], [1] * 60))
    out = floor_mod.Floor(tiny, "").lambada_perplexity(None, [{"context": "", "continuation": ""}])
    assert out == {floor_mod.PPL_FLOOR: math.inf}
    assert floor_mod.BPB_FLOOR == "bpb/unigram_floor"


class _Chars:
    """Bytes as tokens 1..256 (0 the end of text)."""

    def encode(self, text, add_special_tokens=False):
        return [b + 1 for b in text.encode("utf-8")]


def test_floor_bpb_is_the_unigram_models_bits_per_byte():
    from hlm_ray.unigram import unigram_bpb

    model = Unigram(np.arange(257) % 7 + 1, 0.5, "")
    texts = ["abc", "hello there"]
    out = floor_mod.Floor(model, "").bpb(_Chars(), texts)
    assert out == {"bpb/unigram_floor": unigram_bpb(model, _Chars(), texts)["bpb"]}


def test_lambada_perplexity_encodes_each_pair_with_the_tokenizer(monkeypatch):
    import hlm_ray.evaluate.lambada as lambada

    seen = []

    def encode_pair(tokenizer, context, continuation):
        seen.append((tokenizer, context, continuation))
        return [7], [] if continuation == "" else [2]

    monkeypatch.setattr(lambada, "encode_pair", encode_pair)
    model = Unigram(np.array([1, 1, 2, 4]), 0.5, "")
    tok = _Chars()
    examples = [{"context": "c1", "continuation": ""}, {"context": "c2", "continuation": "w"}]
    out = floor_mod.Floor(model, "").lambada_perplexity(tok, examples)
    assert seen == [(tok, "c1", ""), (tok, "c2", "w")]  # an empty continuation scores 0 nats
    assert out[floor_mod.PPL_FLOOR] == pytest.approx(math.exp(-model.log_probs()[2] / 2))


def test_run_floor_takes_the_prepared_folder_first_then_the_counts(tmp_path, monkeypatch, caplog):
    import logging

    from hlm_ray.errors import HLMError

    prepared = _prepared(tmp_path, {"train": [[1, 2, 2, 3]], "val": [[2, 2]]}, 4)
    cfg = SimpleNamespace(data=SimpleNamespace(seq_len=2, max_tokens=None))
    save_counts(tmp_path / COUNTS_FILE, [1, 1, 1, 1])
    pre = SimpleNamespace(run_config=cfg, path=tmp_path)
    asked = []

    def found(c):
        asked.append(c)
        return prepared

    monkeypatch.setattr(floor_mod, "find_prepared", found)
    floor = floor_mod.run_floor(pre)
    assert asked == [cfg] and floor.source == f"the training split of {tmp_path} (4 tokens)"
    assert floor.model.counts.tolist() == [0, 1, 2, 1]

    monkeypatch.setattr(floor_mod, "find_prepared", lambda c: None)
    assert floor_mod.run_floor(pre).source == f"{COUNTS_FILE} beside the model (4 tokens)"

    def refused(c):
        raise HLMError("a shard does not match")

    monkeypatch.setattr(floor_mod, "find_prepared", refused)
    with caplog.at_level(logging.INFO, logger="hlm_ray.evaluate.floor"):
        assert floor_mod.run_floor(pre).source == f"{COUNTS_FILE} beside the model (4 tokens)"
    assert caplog.messages == ["no floor from the prepared folder: a shard does not match"]


def test_find_prepared_opens_the_named_or_the_caches_folder_never_prepares(tmp_path, monkeypatch):
    import hlm_ray.prepare
    from hlm_ray.paths import data_dir
    from hlm_ray.prepare.request import PrepareRequest, default_output
    from hlm_ray.prepare.sources import resolve_sources
    from hlm_ray.presets import load_config

    monkeypatch.setattr(hlm_ray.prepare, "open_prepared", lambda where: ("opened", str(where)))
    named = load_config("tiny-decoder", overrides={"data.prepared": str(tmp_path / "p")})
    assert floor_mod.find_prepared(named) == ("opened", str(tmp_path / "p"))

    text = tmp_path / "corpus.txt"  # a local file that is not in the data folder
    text.write_text("some text\n")
    cfg = load_config("tiny-decoder", overrides={"data.sources": [str(text)]})
    request = PrepareRequest.from_config(cfg)
    folder = Path(default_output(request, request.key(resolve_sources(request.sources))))
    assert floor_mod.find_prepared(cfg) is None  # not prepared yet: nothing is prepared here
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    assert floor_mod.find_prepared(cfg) == ("opened", str(folder))

    hub = load_config("tiny-decoder", overrides={"data.sources": ["someone/a-hub-dataset"]})
    assert floor_mod.find_prepared(hub) is None  # a hub dataset is never fetched for a floor
    assert floor_mod._local(str(text)) and floor_mod._local("corpus/en")
    assert (data_dir() / "corpus" / "en").exists() and not Path("corpus/en").exists()
    assert not floor_mod._local("someone/a-hub-dataset")


def test_cached_counts_record_their_split_and_block_length(tmp_path):
    from hlm_ray.paths import cache_dir
    from hlm_ray.unigram import load_counts

    prepared = _prepared(tmp_path, {"train": [[1, 2, 3, 3]], "val": [[0, 0]]}, 4)
    floor_mod.cached_counts(prepared, "val", 2, None)
    _, meta = load_counts(cache_dir("counts") / f"{'f' * 24}-val-2-all.npz")
    assert meta["source"] == f"val split of {tmp_path}" and meta["seq_len"] == 2


def test_a_floor_perplexity_past_floats_is_inf_not_an_overflow(monkeypatch):
    """exp overflows past 709.78: a mean of -709.9 nats is inf (a bound of 710 raised)."""
    import hlm_ray.evaluate.lambada as lambada

    monkeypatch.setattr(lambada, "encode_pair", lambda tok, c, w: ([], [1]))
    for nats, want in ((-709.9, math.inf), (-708.0, math.exp(708.0))):
        model = SimpleNamespace(log_probs=lambda nats=nats: np.array([0.0, nats]))
        out = floor_mod.Floor(model, "").lambada_perplexity(
            None, [{"context": "", "continuation": ""}]
        )
        assert out == {floor_mod.PPL_FLOOR: want}
