"""A decoder's readouts (hlm_ray.readout): the prior readout adds exactly β·ln q(w) to the scaled
tied logits; each arm reads out through its own default and refuses readouts it cannot have;
the training loop's counting is a histogram of the targets; the fit finds a known scale and
weight; and on text from a known bigram source, a tiny headless model read with the prior is
closer to the true next-token distribution than read through its tied embeddings, while a
vanilla model with the prior added gets further from it. CPU, tiny models: seconds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hlm_ray.config import ModelConfig
from hlm_ray.errors import HLMError
from hlm_ray.evaluate.readouts import compared_readouts
from hlm_ray.models import build_model, hidden_states, input_embedding_weight, lm_head
from hlm_ray.objectives import headless_causal_loss, vanilla_causal_loss
from hlm_ray.pretrained import model_info
from hlm_ray.readout import (
    Readout,
    ReadoutProcessor,
    attach_readout,
    default_readout,
    load_readout,
    resolve_readout,
    write_record,
)
from hlm_ray.readout_fit import fit_prior
from hlm_ray.train.token_counts import count_targets_
from hlm_ray.unigram import COUNTS_FILE, Unigram, save_counts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 40


def tiny(objective: str, arch: str = "gpt_neox", vocab: int = V, hidden: int = 16):
    cfg = ModelConfig(arch=arch, hidden_size=hidden, num_layers=1, num_heads=2, max_positions=64)
    ids = {"eos_token": 0, "pad_token": 0}
    return build_model(cfg, vocab_size=vocab, objective=objective, special_ids=ids)


def folder_of(tmp_path, model, counts=None, record=None, **config):
    """A model folder: config.json and weights, with token counts and readout.json if given,
    and `config` merged into config.json (e.g. hlm_finetuned)."""
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if counts is not None:
        save_counts(folder / COUNTS_FILE, counts, what="test counts")
    if record is not None:
        write_record(folder, record)
    return folder


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_the_prior_readout_adds_exactly_the_natural_log_prior(tmp_path, arch):
    """tied = z/τ and prior = s·z/τ + β·ln q, with q = (c + α)/(N + α·V) computed by hand, z
    the logits transformers computes (h·Eᵀ); through the model's forward, its output layer
    (what the generator's scoring pass calls) and the LogitsProcessor alike."""
    torch.manual_seed(0)
    model = tiny("headless", arch).eval()
    counts = np.arange(V) ** 2 % 17  # zeros among them: smoothing matters
    record = {"temperature": 0.5, "alpha": 0.3, "prior": {"scale": 1.5, "prior_weight": 0.7}}
    folder = folder_of(tmp_path, model, counts, record)
    ids = torch.randint(0, V, (2, 9))
    q = (counts + 0.3) / (counts.sum() + 0.3 * V)
    with torch.no_grad():
        z = model(input_ids=ids).logits.double()
        h = hidden_states(model, ids)
        load_readout(model, folder, "tied")
        tied = model(input_ids=ids).logits.double()
        load_readout(model, folder, "prior")
        prior = model(input_ids=ids).logits.double()
        head = model.get_output_embeddings()(h).double()
    expected = 1.5 * z / 0.5 + 0.7 * torch.from_numpy(np.log(q))
    torch.testing.assert_close(tied, z / 0.5, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prior, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head, expected, rtol=1e-5, atol=1e-5)
    processor = ReadoutProcessor(resolve_readout(folder, "prior"))
    out = processor(ids, z[:, -1].float()).double()
    torch.testing.assert_close(out, expected[:, -1], rtol=1e-5, atol=1e-5)
    # The default readout of a raw headless decoder with counts is the prior; an identity
    # readout puts the model's own layer back.
    assert default_readout(folder) == "prior"
    attach_readout(model, Readout("head"))
    assert type(model.get_output_embeddings()) is torch.nn.Linear


def test_plain_generate_with_the_processor_equals_the_attached_readout(tmp_path):
    """transformers' own `generate()` on a plain model, given `ReadoutProcessor`, makes the text
    the model with the readout attached makes (greedy), and not the raw model's."""
    torch.manual_seed(0)
    model = tiny("headless").eval()
    counts = (np.arange(V) % 7) ** 3
    folder = folder_of(tmp_path, model, counts)
    readout = resolve_readout(folder)
    ids = torch.randint(1, V, (2, 4))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    raw = model.generate(ids, **settings)
    plain = model.generate(ids, logits_processor=[ReadoutProcessor(readout)], **settings)
    attach_readout(model, readout)
    assert torch.equal(plain, model.generate(ids, **settings)) and not torch.equal(plain, raw)


def test_each_arm_reads_out_through_its_own_default_and_refuses_the_others(tmp_path):
    counts = np.full(V, 3)
    raw = folder_of(tmp_path / "raw", tiny("headless"), counts)
    bare = folder_of(tmp_path / "bare", tiny("headless"))
    # A vanilla run records its (unused) objective.temperature; its head's prior ignores it.
    record = {"readout": "head", "temperature": 0.5, "prior": {"scale": 2.0, "prior_weight": 0.3}}
    vanilla = folder_of(tmp_path / "van", tiny("vanilla"), counts, record)
    tuned = folder_of(tmp_path / "ft", tiny("vanilla"), counts, hlm_objective="headless",
                      hlm_finetuned="clm")  # fmt: skip
    assert [default_readout(f) for f in (raw, bare, vanilla, tuned)] == [
        "prior", "tied", "head", "head"
    ]  # fmt: skip
    assert [compared_readouts(model_info(f)) for f in (raw, vanilla, tuned)] == [
        ("tied", "prior"), ("prior",), ()
    ]  # fmt: skip
    # A trained head gets the prior at weight 1 and no scale: the comparison, not a fit.
    prior = resolve_readout(vanilla, "prior")
    assert (prior.scale, prior.prior_weight) == (1.0, 1.0)
    assert resolve_readout(vanilla).is_identity and resolve_readout(tuned).is_identity
    with pytest.raises(HLMError, match="hlm data count --model"):
        resolve_readout(bare, "prior")
    with pytest.raises(HLMError, match="readouts are head, prior"):
        resolve_readout(vanilla, "tied")
    with pytest.raises(HLMError, match="readouts are tied, prior.*hlm finetune --task clm"):
        resolve_readout(raw, "head")


def test_counting_is_a_histogram_of_next_tokens_or_masked_originals():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (4, 17), generator=gen)
    counts = torch.zeros(V, dtype=torch.long)
    count_targets_(counts, ids, None)
    assert torch.equal(counts, torch.bincount(ids[:, 1:].reshape(-1), minlength=V))
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, ids, -100)
    counts.zero_()
    count_targets_(counts, ids, labels)
    assert torch.equal(counts, torch.bincount(labels[labels != -100], minlength=V))


def test_the_fit_recovers_a_known_scale_and_weight():
    """Targets drawn from softmax(0.6·z + 1.3·log q): the fit finds (0.6, 1.3), and scores
    below the derived (1, 1) and the tied (1, 0) readouts on those rows."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6000, V, generator=gen) * 2
    log_q = torch.log_softmax(torch.randn(V, generator=gen) * 2, dim=0)
    y = torch.multinomial(torch.softmax(0.6 * z + 1.3 * log_q, -1), 1, generator=gen)[:, 0]
    fit = fit_prior(z, y, log_q.numpy())
    assert fit["scale"] == pytest.approx(0.6, abs=0.05)
    assert fit["prior_weight"] == pytest.approx(1.3, abs=0.1)
    nats = fit["nats"]
    assert nats["fitted"] < nats["derived"] and nats["fitted"] < nats["tied"]


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_prior_bias_starts_a_vanilla_head_at_log_q_and_comes_back_from_its_folder(tmp_path, arch):
    """`init.prior_bias`: logits = h·Wᵀ + b with b = log q at the start (a tied GPT-2 head stays
    tied), the objective's head trains b, save_pretrained keeps it, plain transformers drops it
    and hlm_ray's loader puts it back. A headless decoder is refused the option."""
    from transformers import AutoModelForCausalLM

    from hlm_ray.head_bias import add_head_bias, head_bias_of, restore_head_bias
    from hlm_ray.presets import load_config

    torch.manual_seed(0)
    model = tiny("vanilla", arch)
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        z = model(input_ids=ids).logits
    log_q = torch.log_softmax(torch.randn(V), 0)
    bias = add_head_bias(model, log_q)
    assert head_bias_of(model) is bias and lm_head(model).bias is bias
    if arch == "gpt2":
        assert model.lm_head.weight is input_embedding_weight(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, z + log_q)
    vanilla_causal_loss(hidden_states(model, ids), ids, lm_head(model)).loss.backward()
    assert bias.grad.abs().sum() > 0
    model.save_pretrained(tmp_path / "m")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m")  # no bias in its head
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, z)
        assert restore_head_bias(plain, tmp_path / "m")
        torch.testing.assert_close(plain(input_ids=ids).logits, z + log_q)
    with pytest.raises(HLMError, match="init.prior_bias=True is not allowed"):
        load_config("tiny-decoder", objective="headless", overrides={"init.prior_bias": True})


def test_a_vanilla_run_with_prior_bias_resumes_and_loads_with_its_bias(tmp_path):
    """Through the real loop (GPT-NeoX, whose head transformers saves as `embed_out`): the
    bias starts at the corpus's log q, trains, survives a resume step for step, and hlm's
    loader gives it back; the card says so and the model's readout stays its head."""
    from tiny_runs import tiny_run_cfg

    from hlm_ray.pretrained import load_pretrained
    from hlm_ray.tracking import read_metrics
    from hlm_ray.train import checkpoint as ckpt
    from hlm_ray.train.loop import train_worker
    from hlm_ray.train.token_counts import corpus_log_prior

    def cfg(out, **extra):
        return tiny_run_cfg(out, objective="vanilla", steps=6, every=(1, 6, 3), vocab=300,
                            **{"init.prior_bias": True, **extra})  # fmt: skip

    full = cfg(tmp_path / "full")
    train_worker(full.to_dict(), progress=False)
    broken = cfg(tmp_path / "broken", **{"run.fail_at_step": 4})
    with pytest.raises(RuntimeError, match="injected failure"):
        train_worker(broken.to_dict(), progress=False)
    last = ckpt.list_checkpoints(tmp_path / "broken")[-1]
    train_worker(broken.to_dict(), resume_from=last, progress=False)
    losses = [
        {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / run) if "train/loss" in r}
        for run in ("full", "broken")
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    pre = load_pretrained(tmp_path / "full", readout="auto")
    bias = pre.model.get_output_embeddings().bias.detach()
    start = torch.as_tensor(corpus_log_prior(full), dtype=bias.dtype)
    assert 0 < (bias - start).abs().max() < 0.1  # trained a little, from log q
    assert pre.readout.is_identity  # a vanilla model reads out through its own head
    card = (tmp_path / "full" / "model" / "README.md").read_text()
    assert "trained bias (started at the log unigram prior" in card


# ----------------------------------------------------------------------------- a bigram source


def bigram_source(vocab: int, seed: int = 0) -> torch.Tensor:
    """P (V, V): P[v, w] = p(next = w | v), skewed toward frequent tokens (Zipf) so that
    token frequencies matter, with a random preference per previous token."""
    gen = torch.Generator().manual_seed(seed)
    zipf = -1.3 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float64))
    return torch.softmax(zipf + 1.5 * torch.randn(vocab, vocab, generator=gen).double(), -1)


def sample(P: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.empty(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, len(P), (batch,), generator=gen)
    for t in range(1, length):
        ids[:, t] = torch.multinomial(P[ids[:, t - 1]], 1, generator=gen)[:, 0]
    return ids


def train(objective: str, P, steps: int, counts_V: torch.Tensor, seed: int = 0):
    """A tiny GPT-NeoX trained on the source with the project's losses; the targets it trained
    on are counted into `counts_V` as the training loop counts them."""
    torch.manual_seed(seed)
    model = tiny(objective, vocab=len(P), hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = sample(P, 32, 33, gen)
        count_targets_(counts_V, ids, None)
        hidden = hidden_states(model, ids)
        if objective == "headless":
            loss = headless_causal_loss(hidden, ids, input_embedding_weight(model)).loss
        else:
            loss = vanilla_causal_loss(hidden, ids, lm_head(model)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def true_cross_entropy(model, P, ids) -> float:
    """Mean over positions of −Σ_w P(w | previous) log p_model(w | context), in nats."""
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1)
    return float(-(P[ids[:, :-1]] * logp).sum(-1).mean())


def test_on_a_bigram_source_the_prior_helps_the_headless_arm_and_hurts_the_vanilla_one(
    tmp_path,
):
    """Against the source's true conditional: headless + prior (derived, weight 1) beats its
    tied readout, and is close to the best weight; vanilla + prior is worse than vanilla. A
    prior with the wrong sign, in the wrong base or given to the wrong arm fails here."""
    P = bigram_source(24)
    held_out = sample(P, 64, 33, torch.Generator().manual_seed(99))
    entropy = float(-(P[held_out[:, :-1]] * P[held_out[:, :-1]].log()).sum(-1).mean())
    scores = {}
    for objective in ("headless", "vanilla"):
        counts = torch.zeros(len(P), dtype=torch.long)
        model = train(objective, P, steps=150, counts_V=counts)
        folder = folder_of(tmp_path / objective, model, counts.numpy())
        for name in ("tied", "prior") if objective == "headless" else ("head", "prior"):
            load_readout(model, folder, name)
            scores[objective, name] = true_cross_entropy(model, P, held_out)
        if objective == "headless":  # the weight the theory gives (1) against the others
            tied = resolve_readout(folder, "tied")
            log_q = Unigram(counts.numpy(), 0.5, "").log_probs()
            for weight in (0.5, 1 / math.log(2), 2.0):  # 1/ln 2: log2 q where ln q belongs
                attach_readout(model, Readout("w", tied.scale, weight, log_q))
                scores["headless", weight] = true_cross_entropy(model, P, held_out)
    excess = {k: v - entropy for k, v in scores.items()}
    assert excess["headless", "prior"] < 0.5 * excess["headless", "tied"], excess
    assert excess["vanilla", "prior"] > excess["vanilla", "head"] + 0.05, excess
    for weight in (0.5, 1 / math.log(2), 2.0):
        assert scores["headless", "prior"] < scores["headless", weight], (weight, excess)
