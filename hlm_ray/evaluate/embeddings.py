"""What the embeddings learned: WordNet synonyms (the paper's Appendix C) and anisotropy.

    from hlm_ray.evaluate.embeddings import anisotropy, synonym_similarity
    synonym_similarity(model, tokenizer, plot_path="synonyms.png")
    # {"synonyms/mean_cos", "synonyms/random_mean_cos", "synonyms/gap", ...}
    anisotropy(model, tokenizer, texts, plot_path="anisotropy.png")
    # {"anisotropy/layer_0", ..., "anisotropy/layer_N", "anisotropy/mean"}

Synonyms: cosine similarity of the *input* embeddings of WordNet synonym pairs whose words are
each one token (in their mid-sentence form, " word"), against random pairs of the same words.
The paper finds headless models put synonyms closer (CWT pulls co-occurring targets together).

Anisotropy: the mean cosine similarity of the representations of two random tokens (different
positions, pooled over all texts), per layer; 0 is isotropic, 1 all vectors point one way.
"""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hlm_ray.errors import HLMError
from hlm_ray.evaluate.common import eval_mode
from hlm_ray.models import body, input_embedding_weight, max_input_positions
from hlm_ray.paths import DATA_ENV, data_dir, has_shared, shared_file

SYNONYMS_FILE = "eval/wordnet_synonym_pairs.tsv.gz"
MIN_PAIRS = 10
_COLUMNS = ("word1", "word2")


# ----------------------------------------------------------------------------- synonyms


def synonym_pairs(
    tokenizer, path: str | Path | None = None
) -> tuple[list[tuple[int, int]], list[str]]:
    """Synonym pairs (id1 < id2) whose two words are each a single token, and those words.

    `path`: a gzip TSV with a ``word1, word2`` header; None reads
    ``eval/wordnet_synonym_pairs.tsv.gz`` from the data folder (there is no hub copy: a missing
    file is an error that says what to provide)."""
    if path is None:
        if not has_shared(SYNONYMS_FILE):
            # No public hub dataset of these pairs is known to the project: say what to provide.
            raise HLMError(
                f"{SYNONYMS_FILE} not found in the data folder {data_dir()} ({DATA_ENV}); the "
                "synonyms task reads only this file (there is no hub fallback for the WordNet "
                "pairs): provide a gzip TSV whose header names word1 and word2, one synonym "
                "pair a row, at that path"
            )
        path = shared_file(SYNONYMS_FILE)
    path = Path(path)
    if not path.is_file():
        raise HLMError(f"no synonym file at {path}; pass a gzip TSV with word1, word2 columns")
    ids: dict[str, int | None] = {}

    def single_token(word: str) -> int | None:
        if word not in ids:
            enc = tokenizer.encode(" " + word, add_special_tokens=False)
            ids[word] = enc[0] if len(enc) == 1 else None
        return ids[word]

    pairs: set[tuple[int, int]] = set()
    words: set[str] = set()
    with gzip.open(path, "rt", encoding="utf-8", newline="") as lines:
        reader = csv.DictReader(lines, delimiter="\t")
        if not set(_COLUMNS) <= set(reader.fieldnames or ()):
            raise HLMError(f"{path}: the header must name word1 and word2, got {reader.fieldnames}")
        for row in reader:
            a, b = single_token(row["word1"]), single_token(row["word2"])
            if a is None or b is None or a == b:
                continue
            pairs.add((min(a, b), max(a, b)))
            words.update((row["word1"], row["word2"]))
    return sorted(pairs), sorted(words)


def synonym_similarity(
    model,
    tokenizer,
    *,
    num_random: int = 10_000,
    seed: int = 0,
    plot_path: str | Path | None = None,
    path: str | Path | None = None,
    title: str | None = None,
) -> dict:
    """Mean cosine of synonym pairs' input embeddings vs `num_random` random pairs of the
    same single-token words; a density histogram of both at `plot_path` if given."""
    pairs, words = synonym_pairs(tokenizer, path)
    if len(pairs) < MIN_PAIRS:
        raise HLMError(
            f"only {len(pairs)} WordNet synonym pairs are single tokens of this "
            f"{len(tokenizer)}-token tokenizer (need {MIN_PAIRS}); the vocabulary is too small "
            "for this analysis"
        )
    with torch.no_grad():
        emb_VD = F.normalize(input_embedding_weight(model).detach().float().cpu(), dim=-1)
    pair_P2 = torch.tensor(pairs)
    syn_P = (emb_VD[pair_P2[:, 0]] * emb_VD[pair_P2[:, 1]]).sum(-1)
    # Random pairs of distinct words from the same vocabulary of single-token words.
    vocab = torch.tensor(sorted({i for pair in pairs for i in pair}))
    first, second = _distinct_pairs(len(vocab), num_random, seed)
    rand_R = (emb_VD[vocab[first]] * emb_VD[vocab[second]]).sum(-1)
    metrics = {
        "synonyms/mean_cos": syn_P.mean().item(),
        "synonyms/random_mean_cos": rand_R.mean().item(),
        "synonyms/gap": syn_P.mean().item() - rand_R.mean().item(),
        "synonyms/num_pairs": len(pairs),
        "synonyms/num_words": len(words),
    }
    if plot_path is not None:
        _plot_histograms(syn_P.numpy(), rand_R.numpy(), plot_path, title or _model_name(model))
    return metrics


def _distinct_pairs(n: int, num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`num` uniform pairs (i, j) of indices below `n` with i != j."""
    if n < 2:
        raise HLMError(f"random pairs need at least 2 items, got {n}")
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, n, (num,), generator=gen)
    # j = i + k (mod n), k in [1, n-1]: uniform over the other n - 1 items.
    second = (first + torch.randint(1, n, (num,), generator=gen)) % n
    return first, second


def _model_name(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "name_or_path", "") or type(model).__name__


def _plot_histograms(syn: np.ndarray, rand: np.ndarray, out: str | Path, title: str) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no global backend, no windows

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    bins = np.linspace(-1, 1, 81)
    ax.hist(rand, bins=bins, density=True, alpha=0.6, label=f"random pairs (n={len(rand)})")
    ax.hist(syn, bins=bins, density=True, alpha=0.6, label=f"WordNet synonyms (n={len(syn)})")
    ax.set_xlabel("cosine similarity of input embeddings")
    ax.set_ylabel("density")
    ax.set_title(f"Synonym similarity: {title}")
    ax.legend()
    return _save(fig, out)


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


# ----------------------------------------------------------------------------- anisotropy


def anisotropy(
    model,
    tokenizer,
    texts: list[str],
    *,
    num_pairs: int = 5000,
    max_tokens: int = 20_000,
    seed: int = 0,
    batch_size: int = 16,
    device: str | None = None,
    plot_path: str | Path | None = None,
    title: str | None = None,
) -> dict:
    """Mean cosine similarity of `num_pairs` random pairs of token representations, per layer
    (layer 0 = the embedding output), pooled over the first `max_tokens` non-pad tokens of
    `texts` (each text truncated to the model's positions). Decoders and encoders alike."""
    hidden = _layer_states(model, tokenizer, texts, max_tokens, batch_size, device)
    num_tokens = hidden[0].shape[0]
    first, second = _distinct_pairs(num_tokens, num_pairs, seed)
    metrics = {}
    for layer, states_ND in enumerate(hidden):
        unit_ND = F.normalize(states_ND, dim=-1)
        metrics[f"anisotropy/layer_{layer}"] = (
            (unit_ND[first] * unit_ND[second]).sum(-1).mean().item()
        )
    values = list(metrics.values())
    metrics["anisotropy/mean"] = sum(values) / len(values)
    metrics["anisotropy/num_tokens"] = num_tokens
    if plot_path is not None:
        _plot_layers(values, plot_path, title or _model_name(model))
    return metrics


def _layer_states(
    model, tokenizer, texts: list[str], max_tokens: int, batch_size: int, device: str | None
) -> list[torch.Tensor]:
    """Per layer, the (N, D) float32 states of the first `max_tokens` non-pad tokens."""
    limit = max_input_positions(getattr(model, "config", None)) or 512
    encoded = [tokenizer.encode(t, add_special_tokens=False)[:limit] for t in texts if t]
    kept, total = [], 0
    for ids in encoded:  # only the texts needed for max_tokens
        if total >= max_tokens:
            break
        kept.append(ids[: max_tokens - total])
        total += len(kept[-1])
    if total < 2:
        raise HLMError("anisotropy needs texts with at least 2 tokens in all")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    per_layer: list[list[torch.Tensor]] = []
    with eval_mode(model, device) as device:
        for start in range(0, len(kept), batch_size):
            chunk = kept[start : start + batch_size]
            width = max(len(ids) for ids in chunk)
            ids_BL = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask_BL = torch.zeros_like(ids_BL)
            for row, ids in enumerate(chunk):
                ids_BL[row, : len(ids)] = torch.tensor(ids)
                mask_BL[row, : len(ids)] = 1
            # The body (no head) of a decoder or encoder: one (B, L, D) per layer, embeddings first.
            out = body(model)(
                input_ids=ids_BL.to(device),
                attention_mask=mask_BL.to(device),
                output_hidden_states=True,
            )
            keep_BL = mask_BL.bool()
            for layer, states_BLD in enumerate(out.hidden_states):
                if layer == len(per_layer):
                    per_layer.append([])
                per_layer[layer].append(states_BLD.float().cpu()[keep_BL])
    return [torch.cat(chunks) for chunks in per_layer]


def _plot_layers(values: list[float], out: str | Path, title: str) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(range(len(values)), values, "o-")
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("mean cosine of random token pairs")
    ax.set_ylim(min(0.0, *values) - 0.05, 1.05)
    ax.set_xticks(range(len(values)))
    ax.grid(alpha=0.3)
    ax.set_title(f"Anisotropy: {title}")
    return _save(fig, out)
