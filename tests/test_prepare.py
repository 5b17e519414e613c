"""hlm_ray.prepare: tokens equal to single-process tokenization whatever the parallelism, the
document-level split, resume, memory-mapped batches, and one clear error per bad input."""

import json
import os
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from hlm_ray import tokenizer as tokmod
from hlm_ray.data import BlockSampler, pack_blocks
from hlm_ray.errors import HLMError
from hlm_ray.prepare import PrepareRequest, TokenBlocks, is_validation, open_prepared, prepare
from hlm_ray.prepare.sources import make_pieces, read_documents, resolve_sources

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "far",
    "away",
    "from",
    "home",
    "and",
    "back",
    "again",
]


def _paragraph(rng, n):
    return " ".join(rng.choice(WORDS, size=n))


@pytest.fixture
def corpus(tmp_path):
    """A folder with paragraph text, line text and JSON lines (~60 KB, ~600 documents)."""
    rng = np.random.default_rng(0)
    root = tmp_path / "corpus"
    root.mkdir()
    paras = [_paragraph(rng, int(rng.integers(5, 60))) for _ in range(300)]
    (root / "a.txt").write_text("\n\n".join(paras) + "\n")
    (root / "b.txt").write_text("\n".join(_paragraph(rng, 12) for _ in range(200)) + "\n")
    rows = [{"text": _paragraph(rng, 20)} for _ in range(100)]
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _request(corpus, **kw):
    base = dict(
        sources=(str(corpus),), vocab_size=300, val_fraction=0.1, shard_tokens=1000,
        piece_bytes=4096,
    )  # fmt: skip
    return PrepareRequest(**{**base, **kw})


def _reference(request, tok):
    """Single process, whole files, document by document: (train tokens, val tokens)."""
    files = resolve_sources(request.sources)
    out = {"train": [], "val": []}
    for piece in make_pieces(files, piece_bytes=1 << 40):
        for doc in read_documents(piece, text_field="text", invalid_utf8="refuse"):
            split = (
                "val" if is_validation(doc, request.split_seed, request.val_fraction) else "train"
            )
            out[split] += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def _tokens(prepared, split):
    return TokenBlocks.open(prepared, split, seq_len=2).read_all().tolist()


def test_pieces_tokenize_like_one_process_and_the_split_is_by_document(corpus, tmp_path):
    request = _request(corpus)
    assert len(make_pieces(resolve_sources(request.sources), piece_bytes=4096)) > 10
    prepared = prepare(request, tmp_path / "out", workers=0, progress=False)
    tok = prepared.tokenizer()
    expected = _reference(request, tok)
    for split in ("train", "val"):
        assert _tokens(prepared, split) == expected[split], split
    m = prepared.manifest
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == len(tok) == 300
    assert len(m["splits"]["train"]["shards"]) > 1
    assert all(s["num_tokens"] == 1000 for s in m["splits"]["train"]["shards"][:-1])
    assert m["splits"]["val"]["num_documents"] > 0
    assert m["splits"]["train"]["num_tokens"] == len(expected["train"])
    # The same request again: the folder is reused as is.
    again = prepare(request, tmp_path / "out", workers=0, progress=False)
    assert again.fingerprint == prepared.fingerprint


def test_the_tokenizer_never_sees_validation_documents(corpus, tmp_path, monkeypatch):
    seen = []
    real = tokmod.train_bpe

    def spy(texts, *args, **kwargs):
        seen.extend(texts)
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(tokmod, "train_bpe", spy)
    request = _request(corpus, val_fraction=0.3)
    prepare(request, tmp_path / "out", workers=0, progress=False)
    docs = [
        d
        for p in make_pieces(resolve_sources(request.sources), piece_bytes=1 << 40)
        for d in read_documents(p, text_field="text", invalid_utf8="refuse")
    ]
    val = {d for d in docs if is_validation(d, 0, 0.3)}
    assert val and seen and not val & set(seen)
    # A bounded sample: seeded, and no more than train_sample_bytes (plus one document).
    seen.clear()
    prepare(replace(request, train_sample_bytes=2000), tmp_path / "small", progress=False)
    assert 2000 <= sum(len(t) for t in seen) < 2000 + max(map(len, docs)) + 1


def test_an_interrupted_preparation_resumes(corpus, tmp_path):
    request = _request(corpus)
    whole = prepare(request, tmp_path / "whole", workers=0, progress=False)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(request, out, workers=0, progress=False, _stop_after_shards=3)
    assert (out / "state.json").exists() and not (out / "manifest.json").exists()
    with pytest.raises(HLMError, match="unfinished preparation"):
        open_prepared(out)
    first = (out / "train-00000.bin").stat().st_mtime_ns
    time.sleep(0.01)
    resumed = prepare(request, out, workers=0, progress=False)
    assert (out / "train-00000.bin").stat().st_mtime_ns == first  # kept, not redone
    assert resumed.manifest["splits"] == whole.manifest["splits"]  # checksums included
    assert not (out / "state.json").exists()
    with pytest.raises(HLMError, match="other sources or settings"):
        prepare(replace(request, val_fraction=0.2), out, workers=0, progress=False)


def test_a_damaged_shard_is_found_before_training_and_prepared_again(
    corpus, tmp_path, monkeypatch, capsys
):
    """A copy of a prepared folder with every 7th token of a shard overwritten was trained on
    without a word (another loss, the clean data's fingerprint in MLflow); out-of-range ids were
    a 70-line IndexError, a truncated shard an mmap error. Each is now one line naming the
    shard, and the command that prepared the folder remakes it."""
    import shutil

    from hlm_ray.prepare import verify

    request = _request(corpus)
    clean = prepare(request, tmp_path / "p1", workers=0, progress=False)
    copy = tmp_path / "p2"
    shutil.copytree(tmp_path / "p1", copy)
    assert open_prepared(copy).fingerprint == clean.fingerprint  # an intact copy passes

    # Read once per file and machine: the verdict is cached by the file's identity.
    verify._seen.clear()
    monkeypatch.setattr(verify, "_scan", lambda *a: pytest.fail("read again"))
    open_prepared(copy)
    monkeypatch.undo()

    shard = copy / "train-00000.bin"
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[::7] = (tokens[::7] + 1) % 300  # still in the vocabulary: only the checksum tells
    tokens.flush()
    with pytest.raises(HLMError) as err:
        open_prepared(copy)
    message = str(err.value)
    assert message.startswith(f"prepared shard {shard}: its content does not match the manifest")
    assert f"`hlm data prepare --output {copy}`" in message and "\n" not in message
    tokens[0] = 65535
    tokens.flush()
    with pytest.raises(HLMError, match="it holds token id 65535, outside the vocabulary of 300"):
        open_prepared(copy)
    del tokens
    val = copy / "val-00000.bin"
    val.write_bytes(val.read_bytes()[:10])
    with pytest.raises(
        HLMError, match=r"val-00000.bin has 10 bytes, the manifest says .*cut short"
    ):
        open_prepared(copy)

    again = prepare(request, copy, workers=0, progress=False)  # the command that made it
    assert "val-00000.bin has 10 bytes, the manifest says" in capsys.readouterr().err
    assert again.fingerprint == clean.fingerprint
    assert open_prepared(copy).fingerprint == clean.fingerprint


def test_a_shard_without_a_checksum_longer_a_folder_or_one_id_past_the_vocabulary(corpus, tmp_path):
    """Item 2: a shard whose manifest entry had no sha256 was trained on changed, under the
    fingerprint of the content it was prepared with. Item 11: a longer shard was said to be
    "cut short", a folder in a shard's place "missing". And an id exactly at the vocabulary's
    size is outside it (a `>` for `>=` in the check passed every test)."""
    import shutil

    from hlm_ray.prepare import verify

    prepare(_request(corpus), tmp_path / "p1", workers=0, progress=False)
    copy = tmp_path / "p2"
    shutil.copytree(tmp_path / "p1", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]["sha256"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HLMError) as err:
        open_prepared(copy)
    assert str(err.value).startswith(
        f"prepared shard {copy / 'train-00000.bin'}: the manifest records no sha256 for it, so "
        "its content cannot be checked (an edited manifest); prepare the folder again: "
        f"`hlm data prepare --output {copy}`"
    )

    shutil.rmtree(copy)
    shutil.copytree(tmp_path / "p1", copy)
    shard = copy / "train-00000.bin"
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[3] = 300  # the vocabulary's size: the first id outside it
    tokens.flush()
    del tokens
    verify._seen.clear()
    problem = verify.shard_problem(copy, json.loads((copy / "manifest.json").read_text()))
    assert problem == (
        "train-00000.bin: its content does not match the manifest's sha256 (changed after it "
        "was prepared); it holds token id 300, outside the vocabulary of 300"
    )
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(HLMError, match=rf"has {size + 2:,} bytes, the manifest says {size:,} "
                       r"\(.* tokens of uint16\): longer: written to or replaced since; "):  # fmt: skip
        open_prepared(copy)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(HLMError, match="train-00000.bin is a folder, not a shard file; "):
        open_prepared(copy)


def test_memory_mapped_batches_equal_the_in_memory_path(corpus, tmp_path):
    prepared = prepare(_request(corpus, shard_tokens=777), tmp_path / "out", progress=False)
    stream = np.array(_tokens(prepared, "train"), dtype=np.int32)
    for max_tokens in (None, 5000):
        cut = stream if max_tokens is None else stream[:max_tokens]
        in_memory = torch.from_numpy(pack_blocks(cut, 16).astype(np.int64))
        mapped = TokenBlocks.open(prepared, "train", seq_len=16, max_tokens=max_tokens)
        assert len(mapped) == len(in_memory)
        sampler = BlockSampler(len(mapped), global_batch=8, seed=3)
        for step in (0, 1, 7, 40):  # blocks straddle shards (777 is no multiple of 16)
            idx = sampler.indices(step)
            assert torch.equal(mapped[idx], in_memory[idx])


def _fails(request, out, match, **kw):
    started = time.perf_counter()
    with pytest.raises(HLMError, match=match):
        prepare(request, out, progress=False, **kw)
    assert not (out / "manifest.json").exists()
    assert not out.exists() or not any(out.iterdir())  # nothing half-written is left
    return time.perf_counter() - started


def test_bad_inputs_fail_with_one_clear_error(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _fails(_request(tmp_path / "missing"), out, "no file or folder")
    binary = tmp_path / "bin" / "x.txt"
    binary.parent.mkdir()
    binary.write_bytes(b"abc\x00\x01\x02" * 10)
    _fails(_request(binary), out, "looks binary")
    bad = tmp_path / "bad" / "latin1.txt"
    bad.parent.mkdir()
    bad.write_bytes(
        b"".join((f"caf\u00e9 {i} " * 30 + "\n\n").encode("latin-1") for i in range(40))
    )
    _fails(_request(bad.parent), out, r"latin1\.txt is not valid UTF-8.*invalid_utf8=replace")
    replaced = prepare(_request(bad.parent, invalid_utf8="replace", val_fraction=0.4,
                                vocab_size=260), out, progress=False)  # fmt: skip
    assert "\ufffd" in replaced.tokenizer().decode(_tokens(replaced, "train")[:50])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "e.txt").write_text("\n\n   \n")
    _fails(_request(empty), tmp_path / "o2", "empty")
    _fails(_request(corpus, vocab_size=5000), tmp_path / "o3", "too small for tokenizer.vocab")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _fails(_request("someone/some-dataset"), tmp_path / "o4", "cannot be reached") < 5
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    assert _fails(_request("someone/some-dataset"), tmp_path / "o5", "cannot be reached") < 5
    # An HLM_DATA_DIR without the corpus: the error says where it looked and what it found
    # there (it said "set HLM_DATA_DIR", which was set).
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    monkeypatch.setenv("HLM_DATA_DIR", str(nothing))
    said = f"no file or folder corpus/en here or in the data folder {nothing} (HLM_DATA_DIR), an empty folder"
    _fails(_request("corpus/en"), tmp_path / "o6", re.escape(said))
    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path / "absent"))
    _fails(
        _request("corpus/en"), tmp_path / "o7", "absent \\(HLM_DATA_DIR\\), which does not exist"
    )


def test_a_task_s_hlm_error_reaches_the_user_as_its_one_line():
    """A sweep prepares its corpora as Ray tasks: a worker's HLMError comes back as Ray's
    RayTaskError, an instance of HLMError too (Ray's dual class) whose text is the task's whole
    traceback. The user sees the worker's one line."""
    from ray.exceptions import RayTaskError

    from hlm_ray.prepare.tokenize import as_hlm_error

    cause = HLMError("data.sources: no file or folder /x/corpus.txt; pass a corpus")
    trace = "Traceback (most recent call last):\n  File ...\nHLMError: " + str(cause)
    wrapped = RayTaskError("_prepare_one", trace, cause).as_instanceof_cause()
    assert isinstance(wrapped, HLMError) and "File ..." in str(wrapped)  # what Ray raises
    for err in (wrapped, RayTaskError("_prepare_one", trace, cause), cause):
        unwrapped = as_hlm_error(err)
        assert type(unwrapped) is HLMError and str(unwrapped) == str(cause)
    try:  # a cause chained by `raise ... from`, as Ray Data's errors carry it
        raise RuntimeError("stage failed") from cause
    except RuntimeError as err:
        assert str(as_hlm_error(err)) == str(cause)
    other = RuntimeError("boom")
    assert as_hlm_error(other) is other  # not ours: passed on as it is


@pytest.mark.ray
def test_ray_data_tokens_equal_one_process_for_1_and_2_workers(ray_cluster, corpus, tmp_path):
    request = _request(corpus, piece_bytes=16384)  # a few pieces: each is a Ray Data task
    inline = prepare(request, tmp_path / "inline", workers=0, progress=False)
    for workers in (1, 2):
        on_ray = prepare(request, tmp_path / f"ray{workers}", workers=workers, progress=False)
        assert on_ray.manifest["splits"] == inline.manifest["splits"], workers
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ok.txt").write_text("fine text here\n\nmore fine text\n" * 50)
    (bad / "z.txt").write_bytes(b"ok\n\n" + b"\xff\xfe broken\n" * 50)
    # Raised in a Ray Data task, in a Ray cluster of its own: a failed preparation's workers can
    # outlive the error, and on the session cluster they held the CPUs a later 2-worker test
    # waited for.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = tmp_path / "o"
    proc = subprocess.run(
        [sys.executable, "-m", "hlm_ray.cli", "data", "prepare", "--preset", "tiny-decoder"]
        + ["--set", f"data.sources=[{bad}]", "--set", "tokenizer.path=tokenizers/gpt2"]
        + ["--output", str(out), "--workers", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "z.txt is not valid UTF-8" in proc.stderr.strip().splitlines()[-1]
    assert "deprecated" not in proc.stderr  # Ray Data's `concurrency=` warned at every prepare
    assert "max_restarts" not in proc.stderr  # an actor pool's error-level line at every start
    assert not out.exists() or not os.listdir(out)
