"""Mutation testing of the core modules against their fast tests: `make mutants` (not part of
`make test` or CI). Each planted bug (a mutant: `<` for `<=`, `+ 1` for `- 1`, a string or a
constant changed, ...) should make some test fail; a mutant no test notices is a promise that
nothing guards. tests/README.md has the last run's kill rate per module and why each survivor
that is left is equivalent (it cannot change what the code does).

    python tests/mutants.py                     # every module of MODULES, one after another
    python tests/mutants.py data optim          # some of them, by key
    python tests/mutants.py --children 1        # mutmut's --max-children (default: 2)

Each module runs mutmut (3.x, the `mutants` extra) in a folder of its own, build/mutants/<key>/,
with only that module mutated and only its own fast tests (no Ray) selected, so a mutant runs
the tests of that selection that call the mutated function, nothing slower. mutmut keeps its
results there: a second run re-tests only functions that changed (delete the folder to start
over). `mutmut show <name>` / `mutmut browse` in that folder show a mutant.

Prints a table (module, mutants, killed, equivalent, kill rate of the others, wall time, load
average) and lists every survivor that is not in EQUIVALENT; exits 1 when a module is under
GOAL. Killed counts what mutmut calls killed, timeout and segfault (the tests noticed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutants"
GOAL = 0.90
NO_RAY = ["-m", "not ray"]
ALSO = ("sweeps",)  # copied beside the mutated package: tests load the sweep scripts

# key: (module, the pytest arguments that select its fast tests). A test file's Ray tests are
# left out (`-m "not ray"`), and so are tests that train through the whole loop for longer than
# a few seconds where plain-function tests cover the same code.
LAMBADA_BPB = "lambada or scored or largest or oracle or batched or truncation or encoding"
LAMBADA_BPB += " or bits_per_byte or bf16_model or trained_context_length or refuse"
MODULES: dict[str, tuple[str, list[str]]] = {
    "cwt": ("hlm_ray/cwt.py", ["tests/test_objectives.py", *NO_RAY]),
    "objectives": ("hlm_ray/objectives.py", ["tests/test_objectives.py", *NO_RAY]),
    "cross_entropy": (
        "hlm_ray/cross_entropy.py",
        [
            "tests/test_objectives.py",
            "tests/test_fused_ce.py",
            "tests/test_cross_entropy.py",
            *NO_RAY,
            "-k",
            "not compiled",
        ],
    ),
    "data": ("hlm_ray/data.py", ["tests/test_data.py", *NO_RAY]),
    "optim": (
        "hlm_ray/train/optim.py",
        ["tests/test_optim.py", *NO_RAY, "-k", "not ddp and not training_with_lazy_update"],
    ),
    "step": (
        "hlm_ray/train/step.py",
        [
            "tests/test_step.py",
            "tests/test_train.py",
            "tests/test_knobs.py",
            *NO_RAY,
            "-k",
            "test_step or skip_mode or four_micro or diverged or anew",
        ],
    ),  # fmt: skip
    "bpb": ("hlm_ray/evaluate/bpb.py", ["tests/test_evaluate.py", *NO_RAY, "-k", LAMBADA_BPB]),
    "lambada": (
        "hlm_ray/evaluate/lambada.py",
        ["tests/test_evaluate.py", *NO_RAY, "-k", LAMBADA_BPB],
    ),
    "stats": (
        "hlm_ray/tune/stats.py",
        ["tests/test_headline.py", "tests/test_scaling.py", *NO_RAY],
    ),
    "scaling_fit": (
        "hlm_ray/tune/scaling_fit.py",
        [
            "tests/test_scaling.py",
            "tests/test_scaling_coverage.py",
            "tests/test_scaling_fit.py",
            *NO_RAY,
        ],
    ),
    "unigram": ("hlm_ray/unigram.py", ["tests/test_unigram.py", *NO_RAY]),
    "guard": (
        "hlm_ray/serve/guard.py",
        ["tests/test_serve_guard.py", "tests/test_serve.py", *NO_RAY, "-k", "guard or bearer"],
    ),
    "floor": ("hlm_ray/evaluate/floor.py", ["tests/test_floor.py", *NO_RAY]),
}

# Survivors that cannot change what the code does, each with one line of why. A name is
# mutmut's (`hlm_ray.cwt.x_cwt_loss__mutmut_3`): it changes when its function is edited, and
# then the mutant shows up as a survivor again, to be looked at again.
_CPU = "a device argument: None is the CPU on this machine (the GPU check runs the losses on CUDA)"
_NO_RNG = "_cwt_rows draws no random numbers: there is no RNG state to preserve"
_FALSY = "None and False are both falsy where the value is only tested for truth"
_CODEC = "codec names are case-insensitive"
_EXACT = ("`<` or `<=` on a float32 uniform draw: they differ only on a draw exactly at the "
          "threshold (about 1 in 2^24)")  # fmt: skip
_PAD = ("right padding under causal attention: no scored position attends to a pad, so the "
        "pads' ids and mask do not reach a score")  # fmt: skip
_ZIP = "zip's strict= over sequences whose lengths are equal by construction"
_START = ("a start of the bounded least-squares search, not the problem: on 300 simulated "
          "curves it finds the same fit (parameters within 1e-3, or rss equal to 1e-9); "
          "checked by simulation, not proven")  # fmt: skip
_FLUSH = "stderr is line-buffered and the line ends in a newline: flush= changes nothing"
EQUIVALENT: dict[str, str] = {
    # tune/stats.py
    "hlm_ray.tune.stats.x__clean__mutmut_3": "scores are Python floats or ints: numpy's own "
    "dtype for them gives the same mean and variance as float64",
    "hlm_ray.tune.stats.x__clean__mutmut_5": "the same: numpy's default dtype for the scores",
    "hlm_ray.tune.stats.x_paired__mutmut_9": "the lengths are checked just above: zip never "
    "sees unequal ones",
    "hlm_ray.tune.stats.x_paired__mutmut_12": "the same: zip's strict= after the length check",
    "hlm_ray.tune.stats.x_paired__mutmut_13": "the same: zip's strict= after the length check",
    # cwt.py
    "hlm_ray.cwt.x__cwt_rows__mutmut_23": _CPU,
    "hlm_ray.cwt.x__cwt_rows__mutmut_25": _CPU,
    "hlm_ray.cwt.x__cwt_per_row__mutmut_5": "chunk_size == K: one checkpointed chunk of all K "
    "rows is the unchunked loss",
    "hlm_ray.cwt.x__cwt_per_row__mutmut_33": _NO_RNG,
    "hlm_ray.cwt.x__cwt_per_row__mutmut_40": _NO_RNG,
    "hlm_ray.cwt.x__cwt_per_row__mutmut_42": _NO_RNG,
    "hlm_ray.cwt.x__cwt_per_row__mutmut_48": "with two chunks or more, every chunk's accuracy "
    "is None or none is: corrects[1] says what corrects[0] says",
    "hlm_ray.cwt.x_cwt_loss__mutmut_6": _CPU,
    "hlm_ray.cwt.x_cwt_loss__mutmut_8": _CPU,
    "hlm_ray.cwt.x_cwt_loss__mutmut_11": "chunking bounds memory, not the value (chunked == "
    "unchunked is tested)",
    "hlm_ray.cwt.x_cwt_loss__mutmut_16": "mask_same is read only with log counts (dedup), "
    "which cwt_loss never passes",
    "hlm_ray.cwt.x_cwt_loss__mutmut_27": "the same: mask_same without log counts is unread",
    "hlm_ray.cwt.x_cwt_loss_from_ids__mutmut_20": _CPU,
    "hlm_ray.cwt.x_cwt_loss_from_ids__mutmut_22": _CPU,
    "hlm_ray.cwt.x_cwt_loss_from_ids__mutmut_87": "the accuracy is then computed and thrown "
    "away: more work, the same loss",
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_10": _CPU,
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_27": _CPU,
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_29": _CPU,
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_44": _CPU,
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_47": _CPU,
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_69": "the positive column is recognised by its "
    "position (top == 0), never by this placeholder id",
    "hlm_ray.cwt.x_cwt_loss_sampled__mutmut_70": "the same placeholder id, never compared",
    # serve/guard.py
    "hlm_ray.serve.guard.xǁBodyGuardǁ__call____mutmut_19": "a scope without a path: neither "
    "'' nor 'XXXX' starts with /-/",
    "hlm_ray.serve.guard.xǁBodyGuardǁ_key_ok__mutmut_3": "no HLM_API_KEY: `not None` is True "
    "as `not ''` is",
    "hlm_ray.serve.guard.xǁBodyGuardǁ_key_ok__mutmut_5": "the same: the default None",
    "hlm_ray.serve.guard.xǁBodyGuardǁ_key_ok__mutmut_20": "no Authorization header: neither "
    "'' nor 'XXXX' is `Bearer <key>`",
    "hlm_ray.serve.guard.xǁBodyGuardǁ_read__mutmut_25": _FALSY,
    "hlm_ray.serve.guard.xǁBodyGuardǁ_read__mutmut_27": _FALSY,
    "hlm_ray.serve.guard.x__header__mutmut_11": "codec names are case-insensitive",
    "hlm_ray.serve.guard.x__replay__mutmut_1": _FALSY,
    "hlm_ray.serve.guard.x__openai_errors__mutmut_22": "no content type: neither b'' nor "
    "b'XXXX' starts with application/json",
    "hlm_ray.serve.guard.x__openai_errors__mutmut_57": _FALSY,
    "hlm_ray.serve.guard.x__openai_errors__mutmut_59": _FALSY,
    # train/step.py
    "hlm_ray.train.step.x_train_step__mutmut_14": _CPU,
    "hlm_ray.train.step.x_train_step__mutmut_16": _CPU,
    "hlm_ray.train.step.x_train_step__mutmut_100": "float() reads 'INF' as it reads 'inf'",
    "hlm_ray.train.step.x_keep_update__mutmut_32": _FLUSH,
    "hlm_ray.train.step.x_keep_update__mutmut_35": _FLUSH,
    "hlm_ray.train.step.x_keep_update__mutmut_39": _FLUSH,
    # evaluate/bpb.py
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_1": "the default batch size: batching "
    "changes no score (1 and 2 at a time are tested equal)",
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_51": "the windows' order only groups them "
    "into batches: the sum over all of them is the same",
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_53": "the same: ascending or descending "
    "length, every window is scored once",
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_55": _PAD,
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_58": _PAD,
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_70": _CPU,
    "hlm_ray.evaluate.bpb.x_bits_per_byte__mutmut_91": _CPU,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_6": "torch.full infers int64 from an int "
    "fill value",
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_9": "the same: int64 from the int pad id",
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_16": _PAD,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_19": _PAD,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_21": _PAD,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_22": _CPU,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_23": _CPU,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_30": _CPU,
    "hlm_ray.evaluate.bpb.x__batch_nats__mutmut_32": _CPU,
    "hlm_ray.evaluate.bpb.x_require_decoder__mutmut_25": "only `== 'encoder'` is read: any "
    "other name for a decoder is a decoder",
    "hlm_ray.evaluate.bpb.x_require_decoder__mutmut_26": "the same: a decoder by another name",
    # train/optim.py
    **{
        f"hlm_ray.train.optim.xǁLazyAdamWǁ_lazy_update__mutmut_{n}": "torch.zeros_like's "
        "default memory_format is preserve_format"
        for n in (15, 17, 22, 24)
    },
    "hlm_ray.train.optim.x_adamw__mutmut_7": "`<` and `<=` differ only for parameters on the "
    "CPU and a GPU at once, which no model here has",
    "hlm_ray.train.optim.x_uses_sparse_embedding__mutmut_5": _FALSY,
    "hlm_ray.train.optim.x_clip_grad_norm__mutmut_19": "get_total_norm's default norm_type is 2.0",
    "hlm_ray.train.optim.x_clip_grad_norm__mutmut_28": _CPU,
    "hlm_ray.train.optim.x_clip_grad_norm__mutmut_31": _CPU,
    "hlm_ray.train.optim.x_clip_grad_norm__mutmut_29": "mul_ by a 0-d tensor casts it to the "
    "gradient's dtype anyway (a 0-d tensor does not promote)",
    "hlm_ray.train.optim.x_clip_grad_norm__mutmut_30": "the same: the 0-d coefficient's dtype",
    # tune/scaling_fit.py
    "hlm_ray.tune.scaling_fit.x_fit_curve__mutmut_45": "y.mean() + b*t.mean() for polyfit's "
    "intercept: the same number when b > 0, up to rounding (t is centred)",
    "hlm_ray.tune.scaling_fit.x_fit_curve__mutmut_47": "run only when b == 0: y.mean() - 0*t "
    "is y.mean() + 0*t exactly",
    **{
        f"hlm_ray.tune.scaling_fit.x_fit_curve__mutmut_{n}": _START
        for n in (93, 95, 96, 97, 106, 116, 117, 118)
    },  # fmt: skip
    "hlm_ray.tune.scaling_fit.x_fit_curve__mutmut_134": "a tie in cost between two starts "
    "keeps the later fit: the same cost (and the same fit on 300 simulated curves)",
    "hlm_ray.tune.scaling_fit.x_fit_curve__mutmut_128": "ln A's bound -51 for -50: A < e^-50 "
    "bits per byte is never reached",
    "hlm_ray.tune.scaling_fit.x_fit_curve__mutmut_130": "ln A's bound 51 for 50: A > e^50 "
    "bits per byte is never reached",
    "hlm_ray.tune.scaling_fit.x_fit_arms__mutmut_8": "numpy's LinAlgError is a ValueError, "
    "suppressed already",
    "hlm_ray.tune.scaling_fit.x_fit_arms__mutmut_10": "the same: LinAlgError is a ValueError",
    "hlm_ray.tune.scaling_fit.x_non_increasing__mutmut_11": "pooling adjacent blocks of equal "
    "means: the same means (the pool-adjacent-violators solution is unique)",
    "hlm_ray.tune.scaling_fit.x_read_compute__mutmut_13": "non_increasing makes every loss a "
    "Python float itself",
    "hlm_ray.tune.scaling_fit.x_read_compute__mutmut_15": "the same: float() on each loss",
    "hlm_ray.tune.scaling_fit.x_compare_arms__mutmut_27": "zip(strict=False) mutated to "
    "strict=None: both are not strict",
    "hlm_ray.tune.scaling_fit.x_compare_arms__mutmut_30": "zip's default is strict=False",
    **{
        f"hlm_ray.tune.scaling_fit.x_compare_arms__mutmut_{n}": "a need of 0 or inf divided by "
        "a positive finite compute is 0 or inf again"
        for n in (59, 63, 64)
    },
    "hlm_ray.tune.scaling_fit.x__row__mutmut_137": "t_quantile's default level is 0.95, LEVEL",
    "hlm_ray.tune.scaling_fit.x_beats_floor__mutmut_7": "describe gives one seed a nan upper "
    "end and two or more finite losses a finite one: the same branch either way",
    "hlm_ray.tune.scaling_fit.x_beats_floor__mutmut_8": "the same: at one seed the upper end "
    "is nan, so the mean is used either way",
    # unigram.py
    "hlm_ray.unigram.x_cross_entropy__mutmut_3": "the held-out counts are integers: their "
    "product with the float64 log-probs is float64 and their sum exact either way",
    "hlm_ray.unigram.x_cross_entropy__mutmut_5": "the same: the integer counts without a dtype",
    "hlm_ray.unigram.x_load_counts__mutmut_4": "np.load checks `not allow_pickle`: None is "
    "falsy as False is, so a pickled file is refused either way",
    "hlm_ray.unigram.x_load_counts__mutmut_6": "np.load's default is allow_pickle=False",
    "hlm_ray.unigram.xǁUnigramǁfit__mutmut_32": "held is read by shape, summed into an int and "
    "made float64 by cross_entropy: the same for the integer counts every caller passes",
    "hlm_ray.unigram.xǁUnigramǁfit__mutmut_34": "the same: held without a dtype",
    "hlm_ray.unigram.xǁUnigramǁfit__mutmut_44": "the grid's temporary models' alpha_source is "
    "never read",
    "hlm_ray.unigram.xǁUnigramǁfit__mutmut_49": "the same: a temporary model's alpha_source",
    "hlm_ray.unigram.xǁUnigramǁlog_probs__mutmut_2": "astype(None) is astype(float64)",
    # cross_entropy.py
    **{
        f"hlm_ray.cross_entropy.x_cross_entropy_head__mutmut_{n}": "_ce_rows draws no random "
        "numbers: there is no RNG state to preserve"
        for n in (87, 95, 99)
    },
    "hlm_ray.cross_entropy.x__fused_linear_cross_entropy__mutmut_38": "torch turns the default "
    "chunking_method 'auto' into None when batch_chunk_size is given, as it always is here",
    "hlm_ray.cross_entropy.x__fused_linear_cross_entropy__mutmut_53": "F.linear_cross_entropy "
    "casts the bias to its logits' dtype itself (on any device)",
    # evaluate/lambada.py
    "hlm_ray.evaluate.lambada.x_score_lambada__mutmut_1": "the default batch size: batching "
    "changes no score (1, 3 and 32 at a time are tested equal to one by one)",
    **{f"hlm_ray.evaluate.lambada.x_score_lambada__mutmut_{n}": _PAD for n in (29, 32)},
    **{f"hlm_ray.evaluate.lambada.x_score_lambada__mutmut_{n}": _CPU for n in (52, 74)},
    **{f"hlm_ray.evaluate.lambada.x_score_lambada__mutmut_{n}": _ZIP for n in (81, 84, 85)},
    **{
        f"hlm_ray.evaluate.lambada.x__score_batch__mutmut_{n}": _ZIP
        for n in (21, 24, 25, 37, 40, 41, 80, 83, 84, 157, 160, 161)
    },
    **{
        f"hlm_ray.evaluate.lambada.x__score_batch__mutmut_{n}": "torch.full infers int64 "
        "from an int fill value"
        for n in (9, 12)
    },
    **{f"hlm_ray.evaluate.lambada.x__score_batch__mutmut_{n}": _PAD for n in (15, 17, 51, 53)},
    **{f"hlm_ray.evaluate.lambada.x__score_batch__mutmut_{n}": _CPU for n in (55, 56, 99)},
    **{
        f"hlm_ray.evaluate.lambada.x_score_lambada_reference__mutmut_{n}": _CPU
        for n in (24, 26, 40, 42)
    },
    **{
        f"hlm_ray.evaluate.lambada.x_score_lambada_reference__mutmut_{n}": "on a 2-D (L, V) "
        "tensor dim +1 is dim -1"
        for n in (33, 49)
    },
    # data.py
    "hlm_ray.data.x__read_utf8__mutmut_1": "the locale's encoding is UTF-8 here and in CI "
    "(Python's UTF-8 mode under the C locale); on a latin-1 locale it would differ",
    "hlm_ray.data.x__read_utf8__mutmut_3": _CODEC,
    "hlm_ray.data.x_not_utf8__mutmut_4": _CODEC,
    "hlm_ray.data.x_not_utf8__mutmut_13": "reading the file whole instead of in chunks: the "
    "same answer, more memory",
    "hlm_ray.data.x_not_utf8__mutmut_29": "an incomplete sequence left at the end is as "
    "invalid followed by b'XXXX' as by nothing",
    "hlm_ray.data.x_corpus_fingerprint__mutmut_3": "texts are hashed one by one: the batch "
    "size only sets how many are read at once",
    "hlm_ray.data.x_corpus_fingerprint__mutmut_9": _CODEC,
    "hlm_ray.data.x_tokenize_corpus__mutmut_17": "the cache file's name: a 33-character "
    "prefix of the key names it as well as 32",
    "hlm_ray.data.x_tokenize_corpus__mutmut_28": "a temporary file's random suffix, 9 "
    "characters or 8",
    "hlm_ray.data.xǁBlockSamplerǁ_permutation__mutmut_2": "the size of the permutation "
    "cache: memory, not the order",
    "hlm_ray.data.xǁBlockSamplerǁ_permutation__mutmut_3": "the same: the cache's size",
    **{
        f"hlm_ray.data.x_mask_tokens__mutmut_{n}": _CPU
        for n in (2, 3, 4, 7, 10, 13, 26, 42, 46, 52, 77, 81, 83, 84)
    },  # fmt: skip
    **{f"hlm_ray.data.x_mask_tokens__mutmut_{n}": _EXACT for n in (33, 57, 62, 64)},
    # objectives.py
    "hlm_ray.objectives.x_vanilla_causal_loss__mutmut_3": "the chunk size bounds memory, not "
    "the value",
    "hlm_ray.objectives.x_vanilla_masked_loss__mutmut_4": "the chunk size bounds memory, not "
    "the value",
    "hlm_ray.objectives.x_vanilla_masked_loss__mutmut_2": "every caller passes impl: the "
    "default is never read",
    "hlm_ray.objectives.x_vanilla_masked_loss__mutmut_3": "every caller passes impl: the "
    "default is never read",
    # evaluate/floor.py
    "hlm_ray.evaluate.floor.xǁFloorǁlambada_perplexity__mutmut_29": "`<=` for `<` differs only "
    "at a mean of exactly -709 nats (e^709 = 8.2e307 reported, not inf): not equivalent there, "
    "but no perplexity a report reads; past 709.78, where exp overflows, both give inf (tested)",
}

# mutmut's exit codes (its `status_by_exit_code`) that mean the tests noticed the mutant.
KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9}  # killed, timeout (SIGXCPU), segfault


@dataclass
class Result:
    key: str
    module: str
    total: int
    killed: int
    equivalent: int
    survivors: list[str]
    stale: list[str]  # listed as equivalent but killed: the list needs updating
    seconds: float
    load: tuple[float, float]  # 1-minute load average before and after

    @property
    def rate(self) -> float:
        counted = self.total - self.equivalent
        return self.killed / counted if counted else 1.0


def setup_cfg(module: str, tests: list[str]) -> str:
    """mutmut's config (setup.cfg: mutmut reads it where there is no pyproject.toml) and
    pytest's (the project's markers and warning filters, from pyproject.toml)."""
    import tomllib

    pytest_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    pytest_cfg = pytest_cfg["ini_options"]
    lines = ["[mutmut]", "source_paths = hlm_ray", f"only_mutate = {module}"]
    lines += ["also_copy =", *(f"    {name}" for name in ALSO)]
    lines += ["pytest_add_cli_args_test_selection =", *(f"    {t}" for t in tests)]
    lines += ["pytest_add_cli_args =", "    -p", "    no:cacheprovider", "", "[tool:pytest]"]
    lines += ["markers =", *(f"    {m}" for m in pytest_cfg["markers"])]
    lines += ["filterwarnings =", *(f"    {f}" for f in pytest_cfg["filterwarnings"])]
    return "\n".join(lines) + "\n"


def prepare(key: str) -> Path:
    """build/mutants/<key>/ with the package and the tests linked in and its own config."""
    folder = WORK / key
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("hlm_ray", "tests", *ALSO):
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    module, tests = MODULES[key]
    (folder / "setup.cfg").write_text(setup_cfg(module, tests))
    return folder


def environment() -> dict[str, str]:
    """One torch thread (mutmut forks its workers from a process that ran torch: OpenMP's
    thread pool does not survive a fork) and the data folder wherever the package is copied."""
    from hlm_ray.paths import DATA_ENV, data_dir

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env[DATA_ENV] = str(data_dir())
    return env


def run_module(key: str, children: int, survivors_only: bool = False) -> Result:
    """mutmut on one module; `survivors_only`: re-test only the last run's survivors (after
    adding tests: mutmut itself re-tests only the mutants of functions that changed)."""
    folder = prepare(key)
    # mutmut beside this Python (the `mutants` extra), or where $MUTMUT names it (a shared
    # environment it is not installed in: `pip install --target DIR mutmut==3.8.1`, then
    # MUTMUT=DIR/bin/mutmut PYTHONPATH=DIR).
    mutmut = os.environ.get("MUTMUT") or Path(sys.executable).with_name("mutmut")
    names = []
    if survivors_only:
        names = summarise(key, folder, 0.0, (0.0, 0.0)).survivors
        if not names:
            return summarise(key, folder, 0.0, (os.getloadavg()[0],) * 2)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    print(f"== {key}: mutmut on {MODULES[key][0]} ({folder.relative_to(ROOT)})", flush=True)
    meta = folder / "mutants" / f"{MODULES[key][0]}.meta"
    before = json.loads(meta.read_text())["exit_code_by_key"] if names else {}
    command = [str(mutmut), "run", "--max-children", str(children), *names]
    subprocess.run(command, cwd=folder, env=environment())
    seconds, load_after = time.perf_counter() - start, os.getloadavg()[0]
    if names:
        keep_earlier_results(meta, before, set(names))
    return summarise(key, folder, seconds, (load_before, load_after))


def keep_earlier_results(meta: Path, before: dict, retested: set[str]) -> None:
    """`mutmut run <names>` forgets the result of every mutant it was not given (mutmut 3):
    put back the earlier results of the mutants that were not re-tested (a test added since
    cannot make a killed mutant survive)."""
    data = json.loads(meta.read_text())
    codes = data["exit_code_by_key"]
    for name, code in before.items():
        if name not in retested and codes.get(name) is None:
            codes[name] = code
    meta.write_text(json.dumps(data))


def summarise(key: str, folder: Path, seconds: float, load: tuple[float, float]) -> Result:
    module = MODULES[key][0]
    meta = folder / "mutants" / f"{module}.meta"
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    killed = [name for name, code in codes.items() if code in KILLED]
    equivalent = [name for name in codes if name in EQUIVALENT and name not in killed]
    survivors = sorted(n for n in codes if n not in killed and n not in EQUIVALENT)
    stale = sorted(n for n in killed if n in EQUIVALENT)
    return Result(key, module, len(codes), len(killed), len(equivalent), survivors, stale,
                  seconds, load)  # fmt: skip


def table(results: list[Result]) -> str:
    lines = [
        "| module | mutants | killed | equivalent | kill rate | wall time | load average |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        minutes = f"{r.seconds / 60:.1f} min" if r.seconds == r.seconds else "-"  # NaN: not run
        load = f"{r.load[0]:.1f} → {r.load[1]:.1f}" if r.load[0] == r.load[0] else "-"
        lines.append(f"| `{r.module}` | {r.total} | {r.killed} | {r.equivalent} | "
                     f"{r.rate:.1%} | {minutes} | {load} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys", nargs="*", choices=[[], *MODULES], metavar="MODULE",
                        help=f"modules to test (default: all): {', '.join(MODULES)}")  # fmt: skip
    parser.add_argument("--children", type=int, default=2, help="mutmut's --max-children")
    parser.add_argument("--survivors", action="store_true",
                        help="re-test only the last run's survivors (after adding tests)")  # fmt: skip
    parser.add_argument("--summary-only", action="store_true",
                        help="print the table of the last runs without running mutmut")  # fmt: skip
    args = parser.parse_args(argv)
    keys = args.keys or list(MODULES)
    results = []
    for key in keys:
        if args.summary_only:
            results.append(summarise(key, WORK / key, float("nan"), (float("nan"),) * 2))
        else:
            results.append(run_module(key, args.children, args.survivors))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print("\n" + table(results))
    for r in results:
        for name in r.survivors:
            print(
                f"survived: {name}   (cd {(WORK / r.key).relative_to(ROOT)} && mutmut show {name})"
            )
        for name in r.stale:
            print(f"killed, but listed in EQUIVALENT: {name}")
    under = [r.key for r in results if r.rate < GOAL]
    if under:
        print(f"under the {GOAL:.0%} goal: {', '.join(under)}")
    return 1 if under else 0


if __name__ == "__main__":
    sys.exit(main())
