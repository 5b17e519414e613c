"""The config tree: presets, overrides, derived batch settings, one-line errors."""

import pytest

from hlm_ray.config import Config
from hlm_ray.errors import HLMError
from hlm_ray.models import hf_config
from hlm_ray.presets import PRESETS, get_preset, load_config


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_validates_and_round_trips(name):
    cfg = get_preset(name)
    assert cfg.preset == name
    assert Config.from_dict(cfg.to_dict()) == cfg
    # The HF config builds for every architecture (no weights allocated).
    hf = hf_config(cfg.model, 50_000, "headless", {"eos_token": 0, "pad_token": 1})
    assert hf.vocab_size == 50_000 and hf.hlm_objective == "headless"


def test_paper_settings_are_carried():
    pythia = get_preset("pythia-70m")
    assert pythia.optim.betas == (0.9, 0.95) and pythia.optim.lr == 1e-3
    assert pythia.optim.warmup_steps == 1430 and pythia.optim.schedule == "cosine"
    assert pythia.data.seq_len == 2048 and pythia.optim.micro_batch_size == 8
    assert pythia.optim.grad_accum_steps(world_size=16) == 8  # 1024 / (8 × 16)
    small = get_preset("gpt2-11m")
    assert (small.model.num_layers, small.model.hidden_size, small.model.num_heads) == (3, 192, 3)
    # bert-base: the paper trained the arms with different device batches (Table 6).
    assert get_preset("bert-base", "vanilla").optim.micro_batch_size == 32
    assert get_preset("bert-base", "headless").optim.micro_batch_size == 64
    assert get_preset("bert-base", "headless").optim.global_batch_size == 512


def test_overrides_yaml_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.01\n  betas: [0.8, 0.9]\ndata:\n  sources: [a.txt, b.txt]\n")
    cfg = load_config("tiny-decoder", yaml_file=path, overrides=["optim.lr=3e-4"])
    assert cfg.optim.lr == 3e-4  # command line wins over the file
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.data.sources == ("a.txt", "b.txt")
    cfg = load_config("tiny-decoder", overrides=["optim.grad_clip=none", "run.fail_at_step=3"])
    assert cfg.optim.grad_clip is None and cfg.run.fail_at_step == 3


def test_a_config_that_is_not_a_file_says_what_it_is(tmp_path):
    """`--config <a folder>` said "not found" for a path that exists."""
    (tmp_path / "a.yaml").write_text("optim:\n  lr: 0.01\n")
    with pytest.raises(HLMError, match=r"is a folder \(it holds a.yaml\); pass one YAML file"):
        load_config("tiny-decoder", yaml_file=tmp_path)
    with pytest.raises(HLMError, match="not found"):
        load_config("tiny-decoder", yaml_file=tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # PyYAML kept the last of two values without a word: the run trained at lr 0.5.
        ("optim:\n  lr: 0.001\n  lr: 0.5\n", "key 'lr' is given twice (lines 2 and 3); keep one"),
        ("optim:\n  lr: 0.1\noptim:\n  warmup_steps: 3\n", "key 'optim' is given twice (lines 1"),
        # A list at the top: AttributeError: 'list' object has no attribute 'items'.
        ("- optim.lr: 0.1\n", "holds a list, not a mapping of sections"),
        # A tab: "while scanning for the next token", the line and column lost.
        ("optim:\n\tlr: 0.1\n", "not valid YAML at line 2, column 1: found character '\\t'"),
        ("optim: [1, 2\n", "not valid YAML at line 2, column 1"),
    ],
    ids=["duplicate-key", "duplicate-section", "top-level-list", "tab", "unclosed"],
)
def test_a_bad_config_file_fails_in_one_line_naming_the_line(text, message, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(HLMError) as err:
        load_config("tiny-decoder", yaml_file=path)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert str(path) in str(err.value)


def test_grad_accumulation_is_derived_and_checked():
    cfg = load_config(
        "tiny-decoder", overrides=["optim.global_batch_size=64", "optim.micro_batch_size=8"]
    )
    assert cfg.optim.grad_accum_steps(world_size=1) == 8
    assert cfg.optim.grad_accum_steps(world_size=4) == 2
    with pytest.raises(HLMError, match="not divisible by micro_batch_size × workers = 8 × 3"):
        cfg.optim.grad_accum_steps(world_size=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr=abc"], "optim.lr='abc' is not allowed; expected float"),
        (["model.arch=lstm"], "model.arch='lstm' is not allowed; choose one of: gpt_neox"),
        (["objective.name=magic"], "objective.name='magic' is not allowed"),
        (["data.seq_len=4096"], "data.seq_len=4096 is not allowed; must not exceed"),
        (["optim.global_batch_size=10"], "global_batch_size=10 is not divisible"),
        (["model.num_heads=3"], "model.num_heads=3 is not allowed; must divide"),
        (["optim.nope=1"], "unknown config field optim.nope"),
        (["optim.lr"], "must look like section.field=value"),
        (["tokenizer.kind=file"], "tokenizer.path=None is not allowed; required when kind=file"),
        (["objective.num_negatives=0"], "objective.num_negatives=0 is not allowed; must be >= 1"),
        (["optim.on_nonfinite=ignore"], "optim.on_nonfinite='ignore' is not allowed; choose"),
        (["optim.max_skipped_steps=0"], "optim.max_skipped_steps=0 is not allowed; must be >= 1"),
        (
            ["objective.num_negatives=8", "objective.cross_worker_negatives=true"],
            "objective.num_negatives=8 is not allowed; samples the worker's own targets",
        ),
    ],
)
def test_invalid_values_fail_with_one_line(overrides, message):
    with pytest.raises(HLMError) as err:
        load_config("tiny-decoder", overrides=overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset_and_objective_list_the_choices():
    with pytest.raises(HLMError, match="unknown preset 'gpt5'; choose one of: tiny-decoder"):
        get_preset("gpt5")
    with pytest.raises(HLMError, match="unknown objective 'x'; choose one of: headless"):
        get_preset("tiny-decoder", objective="x")


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=inf",
        "optim.lr=.inf",
        "optim.lr=-inf",
        "objective.temperature=nan",
        "optim.max_steps=1e400",
        "run.checkpoint_every=1e400",
        "tokenizer.vocab_size=1e400",
        "optim.max_steps=inf",
    ],
)
def test_non_finite_and_overflowing_numbers_fail_in_one_line(override):
    """`inf` passed every `> 0` check and `1e400` for an int ended in an OverflowError
    traceback: every numeric setting is refused at parse time, naming the field."""
    with pytest.raises(HLMError) as err:
        load_config("tiny-decoder", overrides=[override])
    field = override.partition("=")[0]
    assert str(err.value).startswith(f"{field}=") and "not allowed; expected" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_sweep_setting_that_overflows_fails_in_one_line():
    import importlib.util
    from pathlib import Path

    from hlm_ray.tune.spec import get_sweep

    path = Path(__file__).resolve().parents[1] / "sweeps" / "vocab.py"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("v", path))
    module.__spec__.loader.exec_module(module)
    with pytest.raises(HLMError, match=r"^sweep.num_seeds='1e400' is not allowed; expected a fin"):
        get_sweep(module.PRESETS, "tiny", ["sweep.num_seeds=1e400"])
