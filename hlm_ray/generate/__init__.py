"""Text generation from a decoder: greedy or sampled, batched, streamed. No Ray needed.

    gen = Generator.load("runs/tiny-gen")                  # or a checkpoint/model folder, models:/...
    [c] = gen.generate("The cat", max_new_tokens=20, temperature=0)      # greedy
    c.text, c.token_ids, c.finish_reason, c.prompt_tokens, c.completion_tokens
    outs = gen.generate(["a", "b"], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1, n=2)
    for delta in gen.stream("The cat", max_new_tokens=20, stop=["."]):
        print(delta.text, end="")

    [c] = gen.generate("The cat", max_new_tokens=1, logprobs=2, prompt_logprobs=True)
    c.prompt_logprobs[1].logprob, c.logprobs[0].top       # scoring (OpenAI's echo + logprobs)

Sampling is ours, not `model.generate`'s (`hlm_ray.sampling`): per step the float32 logits of each
row get its `logit_bias`, go through temperature, top-k, top-p (the order Hugging Face uses) and
are sampled with the row's own seeded generator, so a seeded row gives the same text alone or
batched with other rows (up to float noise). Log-probabilities (`logprobs`, `prompt_logprobs`) are
the log-softmax, in float32, over the whole vocabulary of the model's *un-filtered* logits: no
bias, temperature, top-k/p or padding mask is applied to them. A prompt is scored in the forward
pass that reads it (one pass, not token by token); `max_new_tokens=0` only scores it. Text is
decoded incrementally (`hlm_ray.detokenize`). Prompts are left-padded into one batch with an attention
mask and explicit positions, and decoded with the KV cache.

A decoder generates through its readout (`hlm_ray.readout`; `Generator.load(..., readout=...)`,
default the model's own): a headless decoder that was never fine-tuned reads its input
embeddings plus the log unigram prior of its training tokens (`prior`), which needs its
token_counts.npz; without one it is refused (`hlm data count` writes it, `hlm finetune --task
clm` gives it a real head, `readout="tied"` or `allow_raw_head=True` use the raw Eᵀ anyway).

The server batches rows of several requests, each row with its own settings, through
`Generator.complete_rows` / `Generator.stream_rows`.

Modules: `params` (SamplingParams, Completion, Delta, Row, row_seed), `stops` (stop sequences
in streamed text), `loading` (which models may generate, served names), `generator` (the
Generator and its decoding loop).
"""

from hlm_ray.generate.generator import Generator
from hlm_ray.generate.loading import check_generation_ready, default_model_name
from hlm_ray.generate.params import Completion, Delta, Row, SamplingParams, row_seed
from hlm_ray.sampling import (  # re-exported: the sampling API predates its module
    TokenLogprob,
    add_logit_bias,
    apply_temperature,
    sample_next,
    token_logprobs,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "Completion",
    "Delta",
    "Generator",
    "Row",
    "SamplingParams",
    "TokenLogprob",
    "add_logit_bias",
    "apply_temperature",
    "check_generation_ready",
    "default_model_name",
    "row_seed",
    "sample_next",
    "token_logprobs",
    "top_k_filter",
    "top_p_filter",
]
