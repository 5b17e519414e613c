"""Models built from config: hidden states, the head's parts, and plain-transformers reloads."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from hlm_ray.config import ModelConfig
from hlm_ray.errors import HLMError
from hlm_ray.models import build_model, hidden_states, input_embedding_weight, lm_head

IDS = {"eos_token": 0, "pad_token": 1, "mask_token": 2}
V = 97


def tiny(arch: str, objective: str):
    cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=2, max_positions=32)
    torch.manual_seed(0)
    return build_model(cfg, vocab_size=V, objective=objective, special_ids=IDS).eval()


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2", "bert", "distilbert"])
def test_vanilla_head_parts_reproduce_the_models_own_logits(arch):
    model = tiny(arch, "vanilla")
    ids = torch.randint(3, V, (2, 16))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        head = lm_head(model)
        feats = head.features(hidden_states(model, ids))
        logits = feats @ head.weight.T + (head.bias if head.bias is not None else 0)
    torch.testing.assert_close(logits, expected)
    assert model.config.vocab_size == V


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_headless_decoder_ties_its_head_and_reloads_with_the_raw_embedding_head(arch, tmp_path):
    model = tiny(arch, "headless")
    assert model.get_output_embeddings().weight is input_embedding_weight(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.hlm_objective == "headless"
    ids = torch.randint(3, V, (2, 16))
    with torch.no_grad():
        hidden = hidden_states(model, ids)
        torch.testing.assert_close(loaded(input_ids=ids).logits, hidden @ model_embedding(model).T)


def model_embedding(model):
    return input_embedding_weight(model).detach()


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_headless_encoder_is_a_bare_body_that_reloads(arch, tmp_path):
    model = tiny(arch, "headless")
    with pytest.raises(HLMError, match="no language-modelling head"):
        lm_head(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, V, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).last_hidden_state, hidden_states(model, ids)
        )


def test_vanilla_encoder_reloads_as_masked_lm(tmp_path):
    model = tiny("bert", "vanilla")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, V, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_eager_attention_matches_sdpa():
    cfg = dict(arch="gpt_neox", hidden_size=32, num_layers=2, num_heads=2, max_positions=32)
    outs = []
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(**cfg, attn_impl=impl), vocab_size=V, objective="vanilla", special_ids=IDS
        ).eval()
        with torch.no_grad():
            outs.append(hidden_states(model, torch.arange(3, 19)[None]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_xformers_without_cuda_says_what_to_do():
    cfg = ModelConfig(arch="gpt2", hidden_size=32, num_layers=1, num_heads=2, attn_impl="xformers")
    with pytest.raises(HLMError, match="xformers needs a CUDA GPU"):
        build_model(cfg, vocab_size=V, objective="vanilla", special_ids=IDS)
