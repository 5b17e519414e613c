"""hlm_ray.sampling's per-token log-probabilities and logit bias as plain functions, against
hand computations (the filters and draws are in test_generate.py)."""

import torch

from hlm_ray.generate import SamplingParams
from hlm_ray.sampling import TokenLogprob, add_logit_bias, token_logprobs


def test_token_logprobs_name_the_target_and_the_k_most_likely():
    logprobs_TV = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]]).log()
    targets_T = torch.tensor([2, 0])
    out = token_logprobs(logprobs_TV, targets_T, k=2)
    assert [(t.token_id, round(t.logprob, 6)) for t in out] == [
        (2, round(float(torch.tensor(0.2).log()), 6)),
        (0, round(float(torch.tensor(0.5).log()), 6)),
    ]
    assert [[i for i, _ in t.top] for t in out] == [[1, 2], [0, 2]]
    assert out[0].top[0][1] == float(logprobs_TV[0, 1])
    none = token_logprobs(logprobs_TV, targets_T, k=0)
    assert [t.top for t in none] == [[], []] and isinstance(none[0], TokenLogprob)


def test_logit_bias_is_added_to_its_rows_tokens_only():
    logits_BV = torch.zeros(3, 4)
    params = [
        SamplingParams(logit_bias=((1, 5.0), (3, -2.5))),
        SamplingParams(),
        SamplingParams(logit_bias=((0, 100.0),)),
    ]
    add_logit_bias(logits_BV, params)
    assert logits_BV.tolist() == [[0, 5, 0, -2.5], [0, 0, 0, 0], [100, 0, 0, 0]]
