"""The protocol details that move scores, each against a hand computation: validation bits per
byte without EOS, budgets in compute, the clm recipes, encoder blocks [CLS] ... [SEP]."""

import math

import pytest
import torch

from hlm_ray.config import Config, apply_overrides
from hlm_ray.models import build_model
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.loop import WorkerEnv
from hlm_ray.train.validate import evaluate

# ----------------------------------------------------------------------------- val/token_bpb


def test_val_token_bpb_leaves_eos_out_as_evaluate_bpb_does():
    eos, vocab = 0, 40
    cfg = apply_overrides(
        Config(),
        {
            "objective.name": "vanilla",
            "model.hidden_size": 16,
            "model.num_heads": 2,
            "data.seq_len": 8,
            "optim.micro_batch_size": 2,
            "optim.global_batch_size": 2,
            "run.eval_batches": 2,
        },
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=vocab, objective="vanilla", special_ids={})
    model.eval()
    token_bytes = torch.randint(1, 5, (vocab,))
    token_bytes[eos] = 0  # EOS stands for no text
    blocks = torch.randint(1, vocab, (4, 8))
    blocks[0, 3] = blocks[1, 0] = blocks[2, 7] = blocks[3, 5] = eos  # documents end mid-block
    val = evaluate(
        LMObjective(model, cfg.objective), blocks, cfg, WorkerEnv(), None, token_bytes, None
    )

    # By hand: -log p of every next token that is not EOS, over the bytes of those tokens.
    nats, num_bytes, ce_all = 0.0, 0, 0.0
    with torch.no_grad():
        logprobs = model(input_ids=blocks).logits.double().log_softmax(-1)
    for b in range(4):
        for t in range(7):
            target = int(blocks[b, t + 1])
            ce_all -= logprobs[b, t, target].item()
            if target != eos:
                nats -= logprobs[b, t, target].item()
                num_bytes += int(token_bytes[target])
    assert val["val/token_bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-5)
    # The loss itself still counts every target (it is what training minimises).
    assert val["val/ce"] == pytest.approx(ce_all / 28, rel=1e-5)
