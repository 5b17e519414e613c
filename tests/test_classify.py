"""Encoder -> classifier fine-tuning: loss, metrics, task data and a tiny end-to-end run."""

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from scipy import stats
from sklearn import metrics as skm

from hlm_ray.classify import TINY, finetune_classifier, load_task, recipe
from hlm_ray.classify.inputs import PairEncoder, encode_split, truncate_pair
from hlm_ray.classify.loss import balanced_cross_entropy, plain_cross_entropy
from hlm_ray.classify.metrics import (
    accuracy,
    average_ranks,
    f1,
    matthews_corrcoef,
    pearson,
    spearman,
    task_metrics,
)
from hlm_ray.classify.model import load_classifier
from hlm_ray.classify.tasks import TASKS, XNLI_LANGUAGES, read_examples, split_indices
from hlm_ray.errors import HLMError
from hlm_ray.paths import data_dir, has_shared
from hlm_ray.presets import load_config
from hlm_ray.tokenizer import load_tokenizer
from hlm_ray.tracking import Tracker
from hlm_ray.train.loop import train_worker

needs_shared = pytest.mark.skipif(not has_shared("eval/glue"), reason="no shared eval data")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """A headless and a vanilla tiny BERT, each trained 4 steps on a slice of Shakespeare."""
    root = tmp_path_factory.mktemp("encoders")
    text = (data_dir() / "corpus/en/tinyshakespeare.txt").read_text()[:60_000]
    (root / "text.txt").write_text(text)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLM_CACHE_DIR", str(root / "cache"))  # never the user's cache
        for objective in ("headless", "vanilla"):
            overrides = {
                "data.sources": [str(root / "text.txt")],
                "tokenizer.vocab_size": 512,
                "optim.max_steps": 4,
                "optim.warmup_steps": 1,
                "run.output_dir": str(root / objective),
                "run.eval_every": 4,
                "run.checkpoint_every": 4,
            }
            cfg = load_config("tiny-encoder", objective=objective, overrides=overrides)
            train_worker(cfg.to_dict(), progress=False)
            out[objective] = root / objective / "model"
    return out


# ----------------------------------------------------------------------------- loss


def test_balanced_cross_entropy_matches_a_hand_computation_on_a_skewed_batch():
    logits = [[2.0, 0.0], [1.0, 0.5], [0.0, 0.0], [3.0, -1.0], [-1.0, 1.0], [0.5, 2.0]]
    labels = [0, 0, 0, 0, 0, 1]  # five of class 0, one of class 1

    def ce(row, y):
        return math.log(sum(math.exp(v) for v in row)) - row[y]

    per_example = [ce(r, y) for r, y in zip(logits, labels, strict=True)]
    mean_0 = sum(per_example[:5]) / 5
    expected = (mean_0 + per_example[5]) / 2  # each class's mean CE, averaged over C = 2
    got = balanced_cross_entropy(torch.tensor(logits), torch.tensor(labels))
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # The paper's sum_c L_c / w_c with batch frequencies w_c = n_c / N, scaled by 1 / (N C).
    paper = sum(
        sum(per_example[i] for i in range(6) if labels[i] == c) / (labels.count(c) / 6)
        for c in (0, 1)
    )
    assert got.item() == pytest.approx(paper / (6 * 2), rel=1e-6)
    # Plain CE weighs the five class-0 examples five times as much.
    plain = plain_cross_entropy(torch.tensor(logits), torch.tensor(labels)).item()
    assert plain == pytest.approx(sum(per_example) / 6, rel=1e-6)
    assert abs(plain - got.item()) > 0.1


def test_balanced_cross_entropy_is_plain_cross_entropy_on_a_balanced_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    labels = torch.tensor([2, 0, 1, 1, 0, 2, 0, 1, 2])
    torch.testing.assert_close(
        balanced_cross_entropy(logits, labels), F.cross_entropy(logits.float(), labels)
    )


# ----------------------------------------------------------------------------- metrics


def test_metrics_match_sklearn_and_scipy():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    preds = np.where(rng.random(200) < 0.7, labels, 1 - labels)
    assert accuracy(preds, labels) == pytest.approx(skm.accuracy_score(labels, preds))
    assert f1(preds, labels) == pytest.approx(skm.f1_score(labels, preds))
    assert matthews_corrcoef(preds, labels) == pytest.approx(skm.matthews_corrcoef(labels, preds))
    labels3, preds3 = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    preds3[:150] = labels3[:150]
    assert matthews_corrcoef(preds3, labels3) == pytest.approx(
        skm.matthews_corrcoef(labels3, preds3)
    )
    # Scores with many ties (rounded), as STS-B's gold scores have.
    gold = np.round(rng.uniform(0, 5, 150), 1)
    pred = np.round(gold + rng.normal(0, 1.0, 150))
    assert pearson(pred, gold) == pytest.approx(stats.pearsonr(pred, gold)[0])
    assert spearman(pred, gold) == pytest.approx(stats.spearmanr(pred, gold)[0])
    np.testing.assert_allclose(average_ranks(pred), stats.rankdata(pred))


def test_degenerate_predictions_score_zero_not_nan():
    labels = np.array([0, 1, 1, 0, 1])
    constant = np.ones(5, dtype=int)
    assert matthews_corrcoef(constant, labels) == skm.matthews_corrcoef(labels, constant) == 0.0
    assert (
        f1(np.zeros(5), np.zeros(5))
        == skm.f1_score(np.zeros(5), np.zeros(5), zero_division=0)
        == 0.0
    )
    assert spearman(np.full(5, 2.0), labels) == 0.0
    assert task_metrics("glue:mrpc", constant, labels) == {
        "accuracy": pytest.approx(0.6),
        "f1": pytest.approx(skm.f1_score(labels, constant)),
    }


# ----------------------------------------------------------------------------- task data

ROWS = {"sst2": 872, "cola": 1043, "mrpc": 408, "rte": 277, "qnli": 5463}


@needs_shared
@pytest.mark.parametrize("task", [*(f"glue:{t}" for t in ROWS), "xnli:en", "xnli:zh"])
def test_every_shared_file_parses_into_a_deterministic_disjoint_split(task):
    data = load_task(task)
    (eval_rows,) = data.eval.values()
    n = ROWS.get(task.removeprefix("glue:"), 2490)
    assert len(data.train) + len(eval_rows) == n
    assert len(eval_rows) == round(0.2 * n)
    assert data.source == "shared-dev-split" and "never report" in data.note
    spec = TASKS[task]
    assert {e.label for e in data.train} == set(range(spec.num_labels))
    assert all(e.text_a and (e.text_b is not None) == spec.is_pair for e in data.train)
    again = load_task(task)
    assert again.train == data.train and again.eval == data.eval
    other = load_task(task, split_seed=1)
    assert other.train != data.train and len(other.train) == len(data.train)
    train_idx, eval_idx = split_indices(n, 0.2, 0)
    assert sorted([*train_idx, *eval_idx]) == list(range(n))  # disjoint, covers every row


@needs_shared
def test_xnli_uses_the_same_rows_in_every_language():
    n = 2490
    train_idx, eval_idx = split_indices(n, 0.2, 0)
    rows = {
        lang: read_examples(data_dir() / TASKS[f"xnli:{lang}"].shared_path, TASKS[f"xnli:{lang}"])
        for lang in XNLI_LANGUAGES
    }
    assert rows["en"][0].label == 1  # "neutral": entailment=0, neutral=1, contradiction=2
    zero_shot = load_task("xnli:en", eval_languages="all")
    assert list(zero_shot.eval) == list(XNLI_LANGUAGES)
    assert zero_shot.train == [rows["en"][i] for i in train_idx]
    for lang in XNLI_LANGUAGES:
        assert zero_shot.eval[lang] == [rows[lang][i] for i in eval_idx]
        assert [e.label for e in zero_shot.eval[lang]] == [e.label for e in zero_shot.eval["en"]]
    # Translate-train: French training rows are never English evaluation rows.
    per_language = load_task("xnli:fr")
    assert list(per_language.eval) == ["fr"]
    assert per_language.train == [rows["fr"][i] for i in train_idx]
    assert not set(train_idx) & set(eval_idx)


def test_bad_files_name_the_file_line_and_field(tmp_path):
    tsv = tmp_path / "train.tsv"
    tsv.write_text("sentence\tlabel\ngood film\t1\nbad film\n")
    with pytest.raises(HLMError, match=r"train\.tsv, line 3: missing field 'label'"):
        load_task("glue:sst2", train_file=tsv, eval_file=tsv)
    jsonl = tmp_path / "rte.jsonl"
    jsonl.write_text(
        '{"premise": "a", "hypothesis": "b", "label": "entailment"}\n'
        '{"premise": "a", "label": "entailment"}\n'
    )
    with pytest.raises(HLMError, match=r"rte\.jsonl, line 2: missing field 'sentence2'"):
        load_task("glue:rte", train_file=jsonl, eval_file=jsonl)
    tsv.write_text("sentence\tlabel\ngood film\tmaybe\n")
    with pytest.raises(HLMError, match=r"line 2: label 'maybe' of glue:sst2 is not one of"):
        load_task("glue:sst2", eval_file=tsv)
    tsv.write_text("text\tlabel\ngood film\t1\n")
    with pytest.raises(HLMError, match=r"line 1: the header has no 'sentence' column"):
        load_task("glue:sst2", eval_file=tsv)


def test_unknown_task_lists_the_tasks():
    with pytest.raises(HLMError, match=r"unknown task 'glue:sst3'; tasks: glue:sst2, .*xnli:zh"):
        load_task("glue:sst3")


def test_no_shared_data_and_no_hub_says_what_to_pass(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub")

    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HLMError, match=r"nyu-mll/glue:sst2 could not be loaded .*HLM_DATA_DIR"):
        load_task("glue:sst2")
    with pytest.raises(HLMError, match=r"shared data has no glue:stsb file.*--train-file"):
        load_task("glue:stsb")


def test_recipes():
    assert recipe("paper", "glue:cola").lr == 1e-5
    assert recipe("paper", "xnli:en").batch_size == 128
    with pytest.raises(HLMError, match="recipes: tiny, paper"):
        recipe("huge", "glue:sst2")


# ----------------------------------------------------------------------------- model


def test_pairs_are_wrapped_in_cls_and_sep_and_truncated_longest_first(encoders):
    tok = load_tokenizer(encoders["headless"])
    plain = tok("a b", add_special_tokens=False)["input_ids"]
    assert tok("a b")["input_ids"] == [tok.cls_token_id, *plain, tok.sep_token_id]  # as framed
    encoder = PairEncoder(tok, 16)
    (ids,) = encoder(load_task("glue:rte", eval_file=_rte_file(encoders)).train[:1])
    a_ids = tok("premise words " * 20, add_special_tokens=False)["input_ids"]
    b_ids = tok("short one", add_special_tokens=False)["input_ids"]
    budget = 16 - 3
    kept_b = min(len(b_ids), budget // 2)
    assert ids == [
        tok.cls_token_id,
        *a_ids[: budget - kept_b],
        tok.sep_token_id,
        *b_ids[:kept_b],
        tok.sep_token_id,
    ]
    for len_a, len_b, budget in itertools.product(range(12), range(12), range(1, 20)):
        assert truncate_pair(len_a, len_b, budget) == _hf_longest_first(len_a, len_b, budget)


def _hf_longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """The reference: the tokenizers library's own truncation of a pair of that many tokens."""
    from tokenizers import Tokenizer, models, processors

    tok = Tokenizer(models.WordLevel({"x": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    tok.enable_truncation(budget, strategy="longest_first")
    enc = tok.encode(["x"] * len_a, ["x"] * len_b, is_pretokenized=True)
    return enc.type_ids.count(0), enc.type_ids.count(1)


def _rte_file(encoders):
    path = encoders["headless"].parent / "rte.jsonl"
    row = {"premise": "premise words " * 20, "hypothesis": "short one", "label": 0}
    path.write_text("\n".join(json.dumps(row) for _ in range(5)) + "\n")
    return path


@pytest.mark.parametrize("objective", ["headless", "vanilla"])
def test_classifier_keeps_every_encoder_weight_and_adds_a_new_head(encoders, objective):
    folder = encoders[objective]
    saved = load_file(folder / "model.safetensors")
    model, new = load_classifier(folder, TASKS["glue:sst2"], torch.device("cpu"))
    assert new == [
        "bert.pooler.dense.bias",
        "bert.pooler.dense.weight",
        "classifier.bias",
        "classifier.weight",
    ]
    body = model.bert.state_dict()
    encoder_keys = [k for k in saved if not k.startswith("cls.")]  # vanilla's MLM head is dropped
    assert len(encoder_keys) > 10
    for key in encoder_keys:
        torch.testing.assert_close(body[key.removeprefix("bert.")], saved[key], rtol=0, atol=0)


def test_a_checkpoint_missing_encoder_weights_is_refused(encoders, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    for path in encoders["headless"].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    weights = load_file(folder / "model.safetensors")
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(HLMError, match=r"1 encoder weights \(e\.g\. bert\.encoder\.layer\.1\."):
        load_classifier(folder, TASKS["glue:sst2"], torch.device("cpu"))


def test_decoder_is_refused(tmp_path):
    folder = tmp_path / "dec"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(
        HLMError, match=r"glue:sst2 needs an encoder; .*dec is a decoder \(gpt_neox\)"
    ):
        finetune_classifier(folder, "glue:sst2", output_dir=tmp_path / "out")


def _quiet_finetune(model, task: str, settings, out: Path, **options) -> dict:
    """`finetune_classifier` without progress bars, its results in `out`."""
    return finetune_classifier(model, task, settings, output_dir=out, progress=False, **options)


class RecordingTracker(Tracker):
    def __init__(self):
        self.metrics, self.params, self.artifacts = [], {}, []

    def log_params(self, params):
        self.params.update(params)

    def log_metrics(self, metrics, step):
        self.metrics.append((step, metrics))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(path)


@needs_shared
def test_tiny_finetune_end_to_end(encoders, tmp_path):
    from transformers import AutoModelForSequenceClassification

    tracker = RecordingTracker()
    settings = replace(TINY, epochs=2, train_limit=96, eval_limit=64)
    result = _quiet_finetune(
        encoders["headless"], "glue:sst2", settings, tmp_path, tracker=tracker, save_best_model=True
    )
    assert json.loads((tmp_path / "classify_glue_sst2.json").read_text()) == result
    (seed,) = result["seeds"]
    assert [e["epoch"] for e in seed["epochs"]] == [1, 2]
    assert all(0.0 <= e["eval/accuracy"] <= 1.0 and e["train/loss"] > 0 for e in seed["epochs"])
    assert seed["best_epoch"] == max(seed["epochs"], key=lambda e: e["eval/accuracy"])["epoch"]
    assert result["summary"]["eval/accuracy"]["mean"] == seed["best"]["eval/accuracy"]
    assert result["data"]["train_examples"] == 96 and result["data"]["eval_examples"] == {
        "eval": 64
    }
    assert seed["steps"] == 2 * 6 and seed["warmup_steps"] == 1
    steps = [step for step, m in tracker.metrics if "seed0/eval/accuracy" in m]
    assert steps == [1, 2] and tracker.params["task"] == "glue:sst2"
    assert (
        tracker.metrics[-1][1]["best/eval/accuracy"] == result["summary"]["eval/accuracy"]["mean"]
    )
    best = AutoModelForSequenceClassification.from_pretrained(result["best_model"])
    assert best.config.hlm_finetuned == "glue:sst2" and best.config.num_labels == 2

    # A transformers pipeline on the saved folder predicts what hlm's own predict path does.
    from transformers import pipeline

    rows = _shared_rows("glue:sst2", 24)
    ours = _hlm_predictions(best, encoders, settings, "glue:sst2", rows)
    clf = pipeline("text-classification", model=result["best_model"], device="cpu")
    theirs = clf([r.text_a for r in rows], batch_size=8, truncation=True)
    assert [best.config.label2id[p["label"]] for p in theirs] == ours


@needs_shared
def test_xnli_zero_shot_and_regression_from_user_files(encoders, tmp_path):
    small = replace(TINY, epochs=1, train_limit=32, eval_limit=24)
    xnli = _quiet_finetune(
        encoders["vanilla"], "xnli:en", small, tmp_path, eval_languages=["en", "fr"]
    )
    assert xnli["main_metric"] == "eval/mean/accuracy"
    (epoch,) = xnli["seeds"][0]["epochs"]
    assert epoch["eval/mean/accuracy"] == pytest.approx(
        (epoch["eval/en/accuracy"] + epoch["eval/fr/accuracy"]) / 2
    )
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"a man plays {i}\ta man plays {i % 7}\t{i % 6}" for i in range(40)]
    (tmp_path / "stsb.tsv").write_text("\n".join(rows) + "\n")
    stsb = _quiet_finetune(
        encoders["headless"], "glue:stsb", small, tmp_path, eval_file=tmp_path / "stsb.tsv"
    )
    assert stsb["data"]["source"] == "file-split" and stsb["settings"]["loss"] == "mse"
    assert set(stsb["summary"]) == {"train/loss", "eval/spearman", "eval/pearson"}
    assert -1.0 <= stsb["summary"]["eval/spearman"]["mean"] <= 1.0


# ----------------------------------------------------------------------------- saved classifiers


def _hlm_predictions(model, encoders, settings, task: str, rows) -> list[int]:
    """What hlm's own predict path gives for `rows` (a pipeline on the saved folder must agree)."""
    from hlm_ray.classify.loop import predict

    spec = TASKS[task]
    encoder = PairEncoder(load_tokenizer(encoders["headless"]), settings.max_length)
    split = encode_split(encoder, rows, spec)
    cpu = torch.device("cpu")
    return predict(model, split, spec, batch_size=8, pad_id=encoder.pad_id, device=cpu).tolist()


def _shared_rows(task: str, n: int):
    data = load_task(task)
    return (data.train + data.eval["eval"])[:n]


@needs_shared
@pytest.mark.parametrize("task", ["glue:sst2", "glue:mrpc"])
def test_saved_tokenizer_builds_the_training_inputs(encoders, tmp_path, task):
    from transformers import AutoTokenizer

    from hlm_ray.classify.template import with_classifier_template

    tok = load_tokenizer(encoders["headless"])
    before = tok.backend_tokenizer.to_str()
    rows = _shared_rows(task, 20)  # real SST-2 sentences / MRPC pairs
    training = _hand_built(tok, 512)(rows)  # long enough: nothing is truncated
    with_classifier_template(tok, max_length=512).save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    for row, ids in zip(rows, training, strict=True):
        args = (row.text_a,) if row.text_b is None else (row.text_a, row.text_b)
        assert saved(*args)["input_ids"] == ids
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert saved.model_max_length == 512
    # Truncated as training truncates (longest first; 40 - 3 specials leaves an odd budget).
    short = with_classifier_template(tok, max_length=40)
    for row, ids in zip(rows, _hand_built(tok, 40)(rows), strict=True):
        args = (row.text_a,) if row.text_b is None else (row.text_a, row.text_b)
        assert short(*args, truncation=True)["input_ids"] == ids
    # The tokenizer it was given is left as it was (the template goes on a copy).
    assert tok.backend_tokenizer.to_str() == before


def _hand_built(tok, max_len: int) -> PairEncoder:
    """The encoder's hand-built path (ids without special tokens, then [CLS]/[SEP] and
    longest-first truncation by hand): what a template must reproduce."""
    encoder = PairEncoder(tok, max_len)
    encoder.own_specials = False
    return encoder


@needs_shared
def test_pipeline_on_a_saved_pair_classifier_predicts_what_hlm_predicts(encoders, tmp_path):
    from transformers import pipeline

    settings = replace(TINY, epochs=1, train_limit=64, eval_limit=32)
    result = _quiet_finetune(
        encoders["headless"], "glue:mrpc", settings, tmp_path, save_best_model=True
    )
    folder = Path(result["best_model"])
    card = (folder / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "- headless" in card
    assert "glue:mrpc" in card and "corpus" in card  # the base encoder's run facts

    rows = _shared_rows("glue:mrpc", 24)
    model, _ = load_classifier(folder, TASKS["glue:mrpc"], torch.device("cpu"))
    ours = _hlm_predictions(model, encoders, settings, "glue:mrpc", rows)
    clf = pipeline("text-classification", model=str(folder), device="cpu")
    pairs = [{"text": r.text_a, "text_pair": r.text_b} for r in rows]
    theirs = clf(pairs, batch_size=8, truncation=True)  # training truncated to max_length too
    assert [model.config.label2id[p["label"]] for p in theirs] == ours
