"""hlm_ray.data: loading, tokenizing (cached), packing, splitting, batch order, BERT masking."""

import json

import numpy as np
import pytest
import torch

from hlm_ray import data as datamod
from hlm_ray.data import (
    BlockSampler,
    corpus_fingerprint,
    load_texts,
    mask_tokens,
    pack_blocks,
    prepare_corpus,
    split_blocks,
    tokenize_corpus,
)
from hlm_ray.errors import HLMError
from hlm_ray.paths import has_shared
from hlm_ray.tokenizer import load_tokenizer, special_tokens_for, train_bpe

DOCS = ["The first document is short.", "A second one, also short: two sentences here."]


@pytest.fixture
def tok():
    texts = [
        " ".join(DOCS * 3) + f" variant {i} of the text, with words and numbers {i * 7}"
        for i in range(30)
    ]
    return load_tokenizer(train_bpe(texts, 300, special_tokens_for("encoder")))


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"text": DOCS[0]}, {"text": ""}, {"text": DOCS[1]}]  # the empty row is dropped
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eos_between_documents(tok, jsonl):
    ds = load_texts([str(jsonl)])
    assert ds.column_names == ["text"] and list(ds["text"]) == DOCS
    eos = tok.eos_token_id
    stream = tokenize_corpus(ds, tok, eos_id=eos)
    first, second = (tok(d, add_special_tokens=False)["input_ids"] for d in DOCS)
    assert stream.dtype == np.int32
    assert stream.tolist() == first + [eos] + second + [eos]
    blocks = pack_blocks(stream, 4)
    assert blocks.shape == (len(stream) // 4, 4)
    assert blocks.flatten().tolist() == stream[: blocks.size].tolist()


def test_text_field_and_txt_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second file\nline two\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "json row"}) + "\n")
    (tmp_path / "notes.md").write_text("ignored: not a supported extension")
    ds = load_texts([str(tmp_path)], text_field="body")
    assert list(ds["text"]) == ["first file\n", "second file\nline two\n", "json row"]
    lines = load_texts([str(tmp_path / "b.txt")], sample_by="line")
    assert list(lines["text"]) == ["second file", "line two"]


def test_tokenized_cache_is_hit(tok, jsonl, monkeypatch, tmp_path):
    ds = load_texts([str(jsonl)])
    first = tokenize_corpus(ds, tok, eos_id=tok.eos_token_id)
    assert len(list((tmp_path / "hlm_cache" / "tokenized").glob("*.npy"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(datamod, "_tokenize", fail)
    np.testing.assert_array_equal(tokenize_corpus(ds, tok, eos_id=tok.eos_token_id), first)
    with pytest.raises(AssertionError):  # another eos id is another stream
        tokenize_corpus(ds, tok, eos_id=tok.pad_token_id)
    assert corpus_fingerprint(ds) == corpus_fingerprint(load_texts([str(jsonl)]))


def test_pack_too_short():
    with pytest.raises(HLMError, match="has 5 tokens.*seq_len=8"):
        pack_blocks(np.arange(5, dtype=np.int32), 8)


def test_val_split_deterministic_and_disjoint():
    blocks = np.arange(100 * 3).reshape(100, 3)
    train, val = split_blocks(blocks, 0.1)
    train2, val2 = split_blocks(blocks, 0.1)
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(val, val2)
    assert len(val) == 10 and len(train) == 90
    train_rows, val_rows = {r[0] for r in train.tolist()}, {r[0] for r in val.tolist()}
    assert not train_rows & val_rows and len(train_rows | val_rows) == 100
    assert val[:, 0].tolist() == [3 * i for i in range(9, 100, 10)]  # spread over the corpus
    tiny_train, tiny_val = split_blocks(blocks[:3], 0.05)
    assert len(tiny_val) == 1 and len(tiny_train) == 2
    with pytest.raises(HLMError, match="no training data"):
        split_blocks(blocks[:1], 0.05)


def test_prepare_corpus(tok, jsonl):
    corpus = prepare_corpus([str(jsonl)], tok, seq_len=4, val_fraction=0.25, eos_id=0)
    assert corpus.train.dtype == torch.long and corpus.train.shape[1] == 4
    assert len(corpus.val) >= 1
    assert len(corpus.train) + len(corpus.val) == corpus.num_tokens // 4
    capped = prepare_corpus([str(jsonl)], tok, seq_len=4, val_fraction=0.25, eos_id=0, max_tokens=9)
    assert capped.num_tokens == 9 and len(capped.train) + len(capped.val) == 2


def test_block_sampler_epochs_shards_and_purity():
    sampler = BlockSampler(num_blocks=10, global_batch=4, seed=3)
    order = torch.cat([sampler.indices(s) for s in range(10)])  # 40 = 4 epochs
    for e in range(4):
        assert sorted(order[10 * e : 10 * (e + 1)].tolist()) == list(range(10))
    assert not torch.equal(order[:10], order[10:20])  # a new permutation per epoch
    fresh = BlockSampler(num_blocks=10, global_batch=4, seed=3)
    assert torch.equal(fresh.indices(7), sampler.indices(7))  # no hidden state
    assert not torch.equal(BlockSampler(10, 4, seed=4).indices(0), sampler.indices(0))
    shards = [sampler.shard(5, rank, 2, micro_batch=1) for rank in range(2)]
    rows = [torch.cat(s).tolist() for s in shards]
    assert all(len(s) == 2 for s in shards)
    assert sorted(rows[0] + rows[1]) == sorted(sampler.indices(5).tolist())
    assert not set(rows[0]) & set(rows[1])
    assert sampler.epoch(5) == pytest.approx(2.0)
    big = BlockSampler(num_blocks=3, global_batch=8, seed=0)  # batch larger than the corpus
    first = big.indices(0).tolist()
    assert len(first) == 8 and sorted(first[:3]) == sorted(first[3:6]) == [0, 1, 2]


def test_w_workers_see_the_micro_batches_one_process_sees_with_w_accumulation_steps():
    """The expectation is the step's global batch cut in order (not `shard` itself): rank r of
    W takes the r-th contiguous slice of `indices(step)`, in micro-batches, so W workers'
    micro-batches, rank after rank, are one process's W·a micro-batches (a accumulation steps
    each) in the same order: same rows per micro-batch, so the same CWT negatives."""
    sampler = BlockSampler(num_blocks=37, global_batch=24, seed=5)  # 24 rows cross epochs
    for step in (0, 1, 7):
        batch = sampler.indices(step).tolist()
        for world, micro in ((1, 24), (1, 6), (2, 6), (3, 4), (4, 3), (2, 12), (6, 2)):
            per_rank = len(batch) // world
            for rank in range(world):
                rows = batch[rank * per_rank : (rank + 1) * per_rank]
                expected = [rows[i : i + micro] for i in range(0, per_rank, micro)]
                got = [m.tolist() for m in sampler.shard(step, rank, world, micro)]
                assert got == expected, (step, world, micro, rank)
        one = [m.tolist() for m in sampler.shard(step, 0, 1, 6)]  # 4 accumulation steps
        workers = [m.tolist() for r in range(4) for m in sampler.shard(step, r, 4, 6)]
        assert workers == one


def test_every_seed_and_epoch_has_its_own_block_order():
    """Epoch orders are drawn from a seed mixed from (seed, epoch): no two pairs share one (with
    seed + epoch, seed s+1's first epoch would be seed s's second)."""
    orders = {}
    for seed in range(6):
        sampler = BlockSampler(num_blocks=50, global_batch=50, seed=seed)  # a step per epoch
        for epoch in range(6):
            orders[seed, epoch] = tuple(sampler.indices(epoch).tolist())
            assert sorted(orders[seed, epoch]) == list(range(50))
    assert len(set(orders.values())) == len(orders)


def _mask_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab, specials = 1000, [0, 1, 2, 3, 4]
    ids_BL = torch.randint(5, vocab, (512, 128), generator=gen)
    ids_BL[:, 0] = 3  # a cls token
    ids_BL[:, -8:] = 1  # padding
    inputs_BL, labels_BL = mask_tokens(
        ids_BL, mask_id=2, special_ids=specials, vocab_size=vocab, generator=gen
    )
    return ids_BL, inputs_BL, labels_BL, specials


def test_mask_tokens_statistics():
    ids_BL, inputs_BL, labels_BL, specials = _mask_batch()
    special_BL = torch.isin(ids_BL, torch.tensor(specials))
    selected_BL = labels_BL != -100
    assert not (selected_BL & special_BL).any()
    assert selected_BL.sum() / (~special_BL).sum() == pytest.approx(0.15, abs=0.01)
    assert torch.equal(labels_BL[selected_BL], ids_BL[selected_BL])  # the ORIGINAL tokens
    assert torch.equal(inputs_BL[~selected_BL], ids_BL[~selected_BL])
    picked = inputs_BL[selected_BL]
    masked = picked == 2
    kept = picked == ids_BL[selected_BL]
    randomised = ~masked & ~kept
    n = selected_BL.sum()
    assert masked.sum() / n == pytest.approx(0.8, abs=0.02)
    assert randomised.sum() / n == pytest.approx(0.1, abs=0.02)
    assert kept.sum() / n == pytest.approx(0.1, abs=0.02)
    assert not torch.isin(picked[randomised], torch.tensor(specials)).any()
    assert not torch.equal(inputs_BL, ids_BL)  # a new tensor; the input was not modified


def test_mask_tokens_is_never_empty_and_leaves_input_alone():
    ids_BL = torch.tensor([[3, 10, 11, 1]])
    before = ids_BL.clone()
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        inputs_BL, labels_BL = mask_tokens(
            ids_BL, mask_id=2, special_ids=[0, 1, 2, 3], vocab_size=50, generator=gen
        )
        assert (labels_BL != -100).sum() >= 1
        assert labels_BL[0, 0] == -100 and labels_BL[0, 3] == -100
    assert torch.equal(ids_BL, before)


@pytest.mark.skipif(not has_shared("corpus/en"), reason="no shared corpus/en")
def test_default_corpus_has_three_documents():
    ds = load_texts(["corpus/en"])
    assert len(ds) == 3 and all(len(t) > 1_000_000 for t in ds["text"])


def test_missing_local_path(tmp_path):
    with pytest.raises(HLMError, match="no file or folder"):
        load_texts([str(tmp_path / "nope")])
    with pytest.raises(HLMError, match="no file or folder corpus/missing.txt"):
        load_texts(["corpus/missing.txt"])


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(HLMError, match="no text found"):
        load_texts([str(tmp_path / "empty.jsonl")])


# ----------------------------------------------------------------------------- edges


def test_text_files_rows_and_what_is_not_text(tmp_path):
    """.txt rows by document, paragraph or line; a bad sample_by, a missing column, a file that
    is not UTF-8 (where and why, for chunks of any size), each with its own one-line error."""
    (tmp_path / "t.txt").write_text("a b\nc\n\n  \nd e\n")
    path = str(tmp_path / "t.txt")
    assert load_texts([path])["text"] == ["a b\nc\n\n  \nd e\n"]
    assert load_texts([path], sample_by="paragraph")["text"] == ["a b\nc", "d e\n"]
    assert load_texts([path], sample_by="line")["text"] == ["a b", "c", "  ", "d e"]
    with pytest.raises(HLMError, match=r"^sample_by='word': use document, paragraph or line$"):
        load_texts([path], sample_by="word")
    with pytest.raises(KeyError, match="title"):
        load_texts([path])["title"]
    bad = tmp_path / "bad"
    cases = {
        b"ok \xc3\xa9 ok": None,
        b"abc\0def": "a NUL byte at offset 3: binary data",
        b"abcdef\xffgh": "byte 0xff at offset 6 is not UTF-8",
        b"abc \xc3": "it ends inside a UTF-8 sequence",
    }
    for raw, why in cases.items():
        bad.write_bytes(raw)
        for chunk in (1, 2, 4, 1 << 20):
            assert datamod.not_utf8(bad, chunk=chunk) == why, (raw, chunk)
    bad.write_bytes(b"abcdef\xffgh")
    (tmp_path / "bad.txt").write_bytes(b"abcdef\xffgh")
    with pytest.raises(HLMError, match=r"bad.txt is not UTF-8 text \(byte 0xff at offset 6 is not"):
        load_texts([str(tmp_path / "bad.txt")])


def test_parquet_and_hub_sources_read_their_text_column(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x y", "", None, "z"]}), tmp_path / "p.parquet")
    assert load_texts([str(tmp_path / "p.parquet")], text_field="body")["text"] == ["x y", "z"]
    with pytest.raises(HLMError, match=r"p.parquet has no 'text' column \(columns: \['body'\]\)"):
        load_texts([str(tmp_path / "p.parquet")])
    calls = []

    class Hub:
        column_names = ["text", "id"]

        def __getitem__(self, column):
            return ["hub one", "", None, "hub two"]

    def load_hub(what, name, config, split):
        calls.append((what, name, config, split))
        return Hub()

    monkeypatch.setattr(datamod, "load_hub", load_hub)
    assert load_texts(["someone/corpus:en"])["text"] == ["hub one", "hub two"]
    assert calls == [("someone/corpus", "someone/corpus", "en", "train")]
    with pytest.raises(HLMError, match=r"someone/corpus has no 'body' column \(columns: \["):
        load_texts(["someone/corpus"], text_field="body")


@pytest.mark.parametrize("source", ["/no/such.file", "./nope", "../nope", "~/nope", "a/b.jsonl"])
def test_a_source_that_looks_like_a_path_is_never_tried_on_the_hub(source, monkeypatch):
    def load_hub(*args):
        raise AssertionError("a path went to the hub")

    monkeypatch.setattr(datamod, "load_hub", load_hub)
    with pytest.raises(HLMError, match="^no file or folder .*; pass an existing path or a hub"):
        load_texts([source])


def test_a_sampler_needs_blocks_and_a_batch():
    for blocks, batch in ((0, 4), (4, 0), (-1, 4), (4, -2)):
        with pytest.raises(HLMError, match=f"^BlockSampler needs blocks and a batch, got "
                           f"num_blocks={blocks}, global_batch={batch}$"):  # fmt: skip
            BlockSampler(blocks, batch, seed=0)
    assert BlockSampler(1, 1, seed=0).indices(5).tolist() == [0]


def test_masking_is_a_function_of_its_generator_and_refuses_all_special_batches():
    """The same generator seed gives the same masks and replacements whatever the global RNG
    did in between; with probability 0 exactly one position is still picked; a batch of only
    special tokens is refused with its own message."""
    ids_BL = torch.randint(5, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    ids_BL[:, 0] = 3

    def masked(seed, probability=0.3, global_seed=0):
        torch.manual_seed(global_seed)  # the global RNG: must not matter
        gen = torch.Generator().manual_seed(seed)
        return mask_tokens(ids_BL, mask_id=2, special_ids=[0, 1, 2, 3], vocab_size=300,
                           probability=probability, generator=gen)  # fmt: skip

    for probability in (0.3, 0.0):
        first, again = masked(0, probability, global_seed=1), masked(0, probability, 2)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        other = masked(1, probability, global_seed=1)  # the same global RNG, another generator
        assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    inputs_BL, labels_BL = masked(0, 0.0)
    assert (labels_BL != -100).sum() == 1 and labels_BL[:, 0].eq(-100).all()
    with pytest.raises(
        HLMError, match="^a batch holds only special tokens; nothing can be masked$"
    ):
        mask_tokens(torch.tensor([[3, 1, 2]]), mask_id=2, special_ids=[1, 3], vocab_size=10)


def test_json_folders_and_what_cannot_be_read_say_so_in_one_line(tmp_path, monkeypatch):
    """A .json array, one object, or JSON lines; a folder read in sorted order across file
    kinds; each refusal word for word."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([{"text": "a1"}, {"text": "a2"}]))
    (folder / "b.json").write_text(json.dumps({"text": "b1"}))
    (folder / "c.json").write_text('{"text": "c1"}\n{"text": "c2"}\n')
    (folder / "d.jsonl").write_text('{"text": "d1"}\n')
    pq.write_table(pa.table({"text": ["e1", "e2"]}), folder / "e.parquet")
    (folder / "f.txt").write_text("f1")
    (folder / "g.csv").write_text("ignored")
    assert load_texts(str(folder))["text"] == ["a1", "a2", "b1", "c1", "c2", "d1", "e1", "e2", "f1"]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{oops\n')
    with pytest.raises(HLMError) as err:
        load_texts([str(tmp_path / "bad.jsonl")])
    assert str(err.value).endswith("bad.jsonl: line 2 is not JSON (Expecting property name "
                                   "enclosed in double quotes)")  # fmt: skip
    (tmp_path / "rows.json").write_text(json.dumps([{"text": "x"}, {"title": "y"}, "z"]))
    with pytest.raises(HLMError) as err:
        load_texts([str(tmp_path / "rows.json")])
    assert str(err.value).endswith("rows.json has rows without a 'text' column; set text_field")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.csv").write_text("x")
    with pytest.raises(HLMError) as err:
        load_texts([str(empty)])
    assert str(err.value) == (f"{empty} holds no .txt/.jsonl/.json/.parquet files; pass a file "
                              "or a folder with text files")  # fmt: skip
    with pytest.raises(HLMError) as err:
        datamod._load_local(empty / "notes.csv", "text", "document")
    assert (
        str(err.value)
        == f"cannot read {empty / 'notes.csv'}: use a .txt, .jsonl, .json or .parquet file"
    )
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(HLMError) as err:
        load_texts(str(tmp_path / "latin.txt"))  # one source as a plain string
    assert str(err.value).endswith("convert it (e.g. `iconv -f latin1 -t utf-8`) or remove it "
                                   "from data.sources")  # fmt: skip
    (tmp_path / "nul.bin").write_bytes(b"ab\0cd\0")
    assert datamod.not_utf8(tmp_path / "nul.bin") == "a NUL byte at offset 2: binary data"

    def offline(*args):
        raise ConnectionError("no network\nsecond line")

    monkeypatch.setattr(datamod, "load_hub", offline)
    monkeypatch.setattr(
        datamod,
        "hub_specs",
        lambda source, field: (
            datamod.HubDataset("org/a", "cfg", "train"),
            datamod.HubDataset("org/b", None, "train"),
        ),
    )
    with pytest.raises(HLMError) as err:
        load_texts(["org/a"])
    assert str(err.value).startswith("no file or folder org/a here or in the data folder ")
    assert ", and the hub dataset org/a:cfg, org/b could not be loaded (no network); point " in (
        str(err.value)
    )
    assert str(err.value).endswith("the folder that holds org/a, or pass a local path")

    # The fingerprint: sha256 of each text's UTF-8 length (8 bytes, little-endian), then bytes.
    expected = hashlib.sha256()
    for text in ("ab", "é"):
        raw = text.encode()
        expected.update(len(raw).to_bytes(8, "little") + raw)
    assert corpus_fingerprint(datamod.Texts(["ab", "é"])) == expected.hexdigest()


def test_an_empty_text_list_tokenizes_to_an_empty_int32_stream(tok):
    stream = datamod._tokenize(datamod.Texts([]), tok, eos_id=0)
    assert stream.dtype == np.int32 and stream.shape == (0,)


# ----------------------------------------------------------------------------- edges, part two


def test_a_json_row_without_the_text_field_is_refused_like_a_row_that_is_not_an_object(
    tmp_path,
):
    for name, body in [("a.jsonl", '{"text": "x"}\n{"title": "y"}\n'), ("b.json", "[1, 2]")]:
        path = tmp_path / name
        path.write_text(body)
        with pytest.raises(HLMError) as err:
            load_texts([str(path)])
        assert str(err.value) == f"{path} has rows without a 'text' column; set text_field"


def test_the_block_order_of_a_seed_is_the_same_in_every_version():
    """A run resumed by a newer hlm_ray must train on the blocks the older one would have: the
    order (seed 3, 10 blocks, 4 a step, 3 epochs' worth) is pinned here, value for value."""
    sampler = BlockSampler(num_blocks=10, global_batch=4, seed=3)
    order = [sampler.indices(step).tolist() for step in range(8)]
    assert order == GOLDEN_ORDER


GOLDEN_ORDER = [
    [4, 5, 0, 1],
    [2, 8, 3, 6],
    [9, 7, 1, 9],
    [5, 6, 4, 3],
    [8, 0, 2, 7],
    [4, 6, 9, 0],
    [8, 5, 1, 2],
    [3, 7, 9, 8],
]


def test_a_pretty_printed_json_object_and_blank_lines_between_json_lines(tmp_path):
    """One object over several lines is one row (not JSON lines); a blank line between JSON
    lines is skipped, the rows after it are read."""
    (tmp_path / "one.json").write_text(json.dumps({"text": "only row", "id": 1}, indent=2))
    assert load_texts([str(tmp_path / "one.json")])["text"] == ["only row"]
    (tmp_path / "gaps.jsonl").write_text('{"text": "a"}\n\n   \n{"text": "b"}\n\n{"text": "c"}\n')
    assert load_texts([str(tmp_path / "gaps.jsonl")])["text"] == ["a", "b", "c"]


def test_a_parquet_file_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import raises ImportError
    with pytest.raises(HLMError) as err:
        load_texts([str(tmp_path / "p.parquet")])
    assert str(err.value) == f"reading {tmp_path / 'p.parquet'} needs pyarrow: pip install pyarrow"


def test_a_hub_dataset_without_the_column_says_to_set_text_field(monkeypatch):
    class Hub:
        column_names = ["body"]

    monkeypatch.setattr(datamod, "load_hub", lambda *args: Hub())
    with pytest.raises(HLMError) as err:
        load_texts(["someone/corpus"])
    assert str(err.value) == (
        "someone/corpus has no 'text' column (columns: ['body']); set text_field"
    )


def test_a_data_folder_source_and_prepare_corpus_read_the_named_column(tmp_path, monkeypatch, tok):
    """text_field reaches a source found in the data folder (HLM_DATA_DIR) and goes through
    prepare_corpus."""
    (tmp_path / "corpus").mkdir()
    rows = [{"body": DOCS[0], "text": "not this"}, {"body": DOCS[1], "text": "nor this"}]
    (tmp_path / "corpus" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path))
    assert load_texts(["corpus"], text_field="body")["text"] == DOCS
    corpus = prepare_corpus(["corpus"], tok, seq_len=2, val_fraction=0.5, eos_id=0,
                            text_field="body")  # fmt: skip
    expected = [t for d in DOCS for t in [*tok(d, add_special_tokens=False)["input_ids"], 0]]
    blocks = torch.stack([corpus.train, corpus.val], dim=1).flatten()  # val: every 2nd block
    assert blocks.tolist() == expected[: len(blocks)] and corpus.num_tokens == len(expected)


def test_documents_are_tokenized_without_the_tokenizers_own_special_tokens(tok):
    """A tokenizer whose post-processor wraps every text in <|cls|> ... <|sep|> (as a BERT
    tokenizer does): the stream is still each document's text tokens and one eos after it."""
    from tokenizers.processors import TemplateProcessing

    cls_id, sep_id = tok.convert_tokens_to_ids(["<|cls|>", "<|sep|>"])
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|cls|> $A <|sep|>", special_tokens=[("<|cls|>", cls_id), ("<|sep|>", sep_id)]
    )
    assert tok(DOCS[0])["input_ids"][0] == cls_id  # the wrapping is on by default
    eos = tok.eos_token_id
    stream = datamod._tokenize(datamod.Texts(DOCS), tok, eos_id=eos)
    first, second = (tok(d, add_special_tokens=False)["input_ids"] for d in DOCS)
    assert stream.tolist() == [*first, eos, *second, eos]


def test_an_eos_id_outside_the_vocabulary_is_refused(tok, jsonl):
    ds = load_texts([str(jsonl)])
    for eos_id in (len(tok), -1):
        with pytest.raises(HLMError) as err:
            tokenize_corpus(ds, tok, eos_id=eos_id)
        assert str(err.value) == (f"eos_id={eos_id} is not a token id of this {len(tok)}-token "
                                  "tokenizer; pass tokenizer.eos_token_id")  # fmt: skip
    assert tokenize_corpus(ds, tok, eos_id=len(tok) - 1)[-1] == len(tok) - 1


def test_block_length_and_validation_fraction_bounds():
    stream = np.arange(10, dtype=np.int32)
    assert pack_blocks(stream, 1).shape == (10, 1)
    for seq_len in (0, -3):
        with pytest.raises(HLMError) as err:
            pack_blocks(stream, seq_len)
        assert str(err.value) == f"seq_len={seq_len} must be positive"
    blocks = np.arange(20).reshape(10, 2)
    for fraction in (0, 0.0, 1, 1.0, 1.5, -0.1):
        with pytest.raises(HLMError) as err:
            split_blocks(blocks, fraction)
        assert str(err.value) == (f"val_fraction={fraction} must be between 0 and 1 (e.g. 0.05)")
    # round(1 / 0.9) = 1: every block would be held out, so none is left to train on.
    with pytest.raises(HLMError, match="^10 blocks leave no training data with val_fraction=0.9"):
        split_blocks(blocks, 0.9)
    train, val = split_blocks(blocks, 0.5)
    assert val[:, 0].tolist() == [2, 6, 10, 14, 18] and len(train) == 5


def test_masking_keeps_the_ids_dtype_and_draws_from_the_one_allowed_token():
    """int32 ids (the token stream's dtype) stay int32; with one non-special token in the
    vocabulary every random replacement is that token; with none, a one-line error."""
    ids_BL = torch.full((64, 64), 4, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    inputs_BL, labels_BL = mask_tokens(ids_BL, mask_id=2, special_ids=[0, 1, 3], vocab_size=5,
                                       probability=0.5, generator=gen)  # fmt: skip
    assert inputs_BL.dtype == labels_BL.dtype == torch.int32
    assert set(inputs_BL.unique().tolist()) == {2, 4}  # masked, or 4 (kept or drawn: 4 again)
    with pytest.raises(HLMError) as err:
        mask_tokens(ids_BL, mask_id=2, special_ids=[0, 1, 3, 4], vocab_size=5)
    assert str(err.value) == "a batch holds only special tokens; nothing can be masked"
    with pytest.raises(HLMError) as err:
        datamod._non_special_ids(4, torch.tensor([0, 1, 2, 3]))
    assert str(err.value) == "vocab_size=4 has no non-special token to sample"
