"""per_device_train_batch_size auto: the largest micro-batch whose memory estimate fits the device with the margin."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO

from fsdp_recipes.config import batch_size
from fsdp_recipes.config.batch_size import MARGIN, MAX_AUTO_BATCH, choose, setup_for_run, take_auto
from fsdp_recipes.config.memory import GiB, ModelShape, Setup, estimate, model_shape
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.plan import Plan
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.preflight import choose_batch_size

# Shapes as fsdp_recipes.config.memory.model_shape reads them: Llama-3.2-1B (tied 128,256 vocabulary), Llama-3.1-8B,
# a Qwen3-like decoder with per-head norms and a wider query, GPT-2 medium (no gated MLP: the GPT formula)
SHAPES = {
    "llama-3.2-1b": ModelShape(
        params=1_235_814_400,
        hidden=2048,
        layers=16,
        vocab=128_256,
        heads=32,
        largest_unit=262_668_288,
        intermediate=8192,
        kv_width=512,
        gated=True,
        q_width=2048,
        kv_heads=8,
    ),
    "llama-3.1-8b": ModelShape(
        params=8_030_261_248,
        hidden=4096,
        layers=32,
        vocab=128_256,
        heads=32,
        largest_unit=525_336_576,
        intermediate=14336,
        kv_width=1024,
        gated=True,
        q_width=4096,
        kv_heads=8,
    ),
    "qwen3-like": ModelShape(
        params=4_000_000_000,
        hidden=2560,
        layers=36,
        vocab=151_936,
        heads=32,
        largest_unit=388_956_160,
        intermediate=9728,
        kv_width=1024,
        gated=True,
        q_width=4096,
        kv_heads=8,
        qk_norm=True,
    ),
    "gpt2-medium": ModelShape(params=354_823_168, hidden=1024, layers=24, vocab=50257, heads=16),
}
SETUPS = [
    Setup(strategy="FULL_SHARD", nproc_per_node=1, seq_len=1024),
    Setup(strategy="FULL_SHARD", nproc_per_node=8, seq_len=2048),
    Setup(strategy="SHARD_GRAD_OP", nproc_per_node=8, seq_len=4096, activation_checkpointing=True),
    Setup(strategy="DDP", nproc_per_node=2, seq_len=512),
    Setup(strategy="FULL_SHARD", nproc_per_node=4, seq_len=2048, offload=True),
    Setup(strategy="HYBRID_SHARD", nproc_per_node=8, nnodes=2, seq_len=8192, activation_checkpointing=True),
]
CARDS = [24 * GiB, 40 * GiB, 80 * GiB, 141 * GiB, 192 * GiB]


def need(shape: ModelShape, setup: Setup, batch: int) -> float:
    return estimate(shape, replace(setup, micro_batch=batch)).gpu_total


def cases():
    for (name, shape), setup, card in itertools.product(SHAPES.items(), SETUPS, CARDS):
        # the ones where nothing fits: the next test
        if need(shape, setup, 1) <= (1 - MARGIN) * card:
            yield pytest.param(shape, setup, card, id=f"{name}-{setup.strategy}-{setup.seq_len}-{card / GiB:.0f}GiB")


@pytest.mark.parametrize("shape, setup, card", list(cases()))
def test_the_chosen_batch_fits_and_one_more_does_not(shape, setup, card):
    choice = choose(shape, setup, card)
    budget = (1 - MARGIN) * card
    assert 1 <= choice.batch <= MAX_AUTO_BATCH
    assert choice.need == need(shape, setup, choice.batch) <= budget
    if choice.batch < MAX_AUTO_BATCH:
        assert need(shape, setup, choice.batch + 1) > budget
        assert choice.next_need == need(shape, setup, choice.batch + 1)
    line = batch_size.describe(choice, setup, "this GPU's memory")
    assert "\n" not in line and f"auto: {choice.batch} sequence(s) of {setup.seq_len} tokens" in line


def test_the_cap_stops_the_choice_and_is_said():
    tiny = model_shape(str(REPO / "assets" / "tiny-llama"))
    setup = Setup(strategy="FULL_SHARD", nproc_per_node=1, seq_len=128)
    choice = choose(tiny, setup, 80 * GiB)
    assert choice.batch == MAX_AUTO_BATCH and choice.next_need is None
    assert f"the cap of {MAX_AUTO_BATCH}" in batch_size.describe(choice, setup, "80 GiB")
    assert choose(tiny, setup, 80 * GiB, cap=7).batch == 7


@pytest.mark.parametrize("card", [1 * GiB, 8 * GiB, 16 * GiB])
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-like"])
def test_nothing_fits_is_one_line_naming_the_fixes(name, card):
    setup = Setup(strategy="FULL_SHARD", nproc_per_node=1, seq_len=4096)
    with pytest.raises(ValueError) as err:
        choose(SHAPES[name], setup, card)
    message = str(err.value)
    assert "\n" not in message and "not even 1 sequence of 4096 tokens fits" in message
    assert "activation_checkpointing" in message and "tools/estimate_memory.py" in message


@pytest.mark.parametrize(
    "recipe_value, argv, expected_argv, auto",
    [
        ("auto", [], [], True),
        ("AUTO ", [], [], True),
        (4, ["--per_device_train_batch_size", "auto"], ["--per_device_train_batch_size", "1"], True),
        (None, ["--per_device_train_batch_size=Auto"], ["--per_device_train_batch_size=1"], True),
        ("auto", ["--per_device_train_batch_size", "8"], ["--per_device_train_batch_size", "8"], False),
        ("auto", ["--per_device_train_batch_size=8"], ["--per_device_train_batch_size=8"], False),
        (4, ["--per_device_eval_batch_size", "auto"], ["--per_device_eval_batch_size", "auto"], False),
        # dashed
        (4, ["--per-device-train-batch-size", "auto"], ["--per-device-train-batch-size", "1"], True),
        (4, ["--per-device-train-batch-size=auto"], ["--per-device-train-batch-size=1"], True),
        (4, [], [], False),
    ],
)
def test_auto_is_taken_from_the_recipe_or_a_flag_and_the_flag_wins(recipe_value, argv, expected_argv, auto):
    recipe = {} if recipe_value is None else {"per_device_train_batch_size": recipe_value}
    new_recipe, new_argv, asked = take_auto(recipe, list(argv))
    assert (new_argv, asked) == (expected_argv, auto)
    if batch_size.is_auto(recipe_value):
        # the placeholder the type checks see
        assert new_recipe["per_device_train_batch_size"] == 1
    else:
        assert new_recipe == recipe


def test_a_recipe_asking_for_auto_parses_and_the_plan_says_so(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"config_name: {REPO / 'assets' / 'tiny-llama'}\ntrain_file: {REPO / 'assets' / 'data' / 'tiny_corpus.txt'}\n"
        "block_size: 128\nmax_steps: 2\nper_device_train_batch_size: auto\n"
    )
    argv = [str(recipe), "--output_dir", str(tmp_path / "out"), "--allow_no_fsdp", "true"]
    plan = parse_args(argv)[2]
    assert plan.auto_batch and plan.raw.per_device_train_batch_size == 1
    plan = parse_args([*argv, "--per_device_train_batch_size", "3"])[2]
    assert not plan.auto_batch and plan.raw.per_device_train_batch_size == 3


def training_args(world=1, **changes):
    values = {"world_size": world, "bf16": False, "fp16": False, "optim": "adamw_torch_fused"}
    return SimpleNamespace(**{"gradient_checkpointing": False, **values, **changes}, process_index=0)


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize(
    "config", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "accelerate_configs").rglob("*.yaml"))
)
def test_the_launch_is_estimated_as_it_runs(config, world, monkeypatch):
    from fsdp_recipes.config.strategy import strategy_of

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    cfg = yaml.safe_load((REPO / config).read_text())
    setup = setup_for_run(cfg, training_args(world), 2048)
    strategy = strategy_of(cfg)
    # FSDP1 alone: NO_SHARD, as torch runs it
    assert setup.strategy == strategy.memory_strategy_on(world, world)
    assert (setup.offload, setup.nproc_per_node * setup.nnodes, setup.seq_len) == (strategy.offload, world, 2048)
    assert setup.precision == {"no": "fp32"}.get(cfg.get("mixed_precision", "no"), cfg.get("mixed_precision"))


@pytest.mark.parametrize(
    "changes, fsdp, expected",
    [
        ({"optim": "adamw_bnb_8bit"}, {}, {"optimizer": "adamw_8bit"}),
        ({"optim": "sgd"}, {}, {"optimizer": "sgd_momentum"}),
        ({"optim": "adafactor"}, {}, {"optimizer": "adamw"}),
        ({"gradient_checkpointing": True}, {}, {"activation_checkpointing": True}),
        ({}, {"fsdp_activation_checkpointing": "true"}, {"activation_checkpointing": True}),
        ({"bf16": True}, {}, {"precision": "bf16"}),
        ({"fp16": True}, {}, {"precision": "fp16"}),
    ],
)
def test_the_runs_own_settings_reach_the_estimate(changes, fsdp, expected, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, **fsdp}}
    setup = setup_for_run(config, training_args(2, **changes), 512)
    assert {k: getattr(setup, k) for k in expected} == expected


def test_without_an_accelerate_config_the_run_is_estimated_unsharded(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert setup_for_run(None, training_args(4), 512).strategy == "NO_SHARD"


def plan_for(model: Path, block_size: int) -> Plan:
    raw = SimpleNamespace(model_name_or_path=None, config_name=str(model), block_size=block_size)
    config = {"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 2}}
    return Plan(raw, launch=SimpleNamespace(config=config), run_args=SimpleNamespace(zero1=False), auto_batch=True)


def test_a_run_chooses_before_loading_and_says_it_in_one_line(monkeypatch):
    monkeypatch.setattr(batch_size, "device_memory", lambda: (40 * GiB, "this GPU's 40.00 GiB"))
    lines = []
    model = REPO / "assets" / "tiny-llama"
    chosen = choose_batch_size(plan_for(model, 64), training_args(), say=lines.append)
    assert chosen == MAX_AUTO_BATCH and len(lines) == 1 and "this GPU's 40.00 GiB" in lines[0]
    # a card too small for one sequence: one line, before anything is loaded
    monkeypatch.setattr(batch_size, "device_memory", lambda: (1024**2, "this GPU's 1.00 MiB"))
    with pytest.raises(RecipeError, match="not even 1 sequence of 64 tokens fits"):
        choose_batch_size(plan_for(model, 64), training_args(), say=lines.append)


def test_without_a_gpu_the_host_memory_over_the_nodes_processes_is_the_budget(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host = batch_size.os.sysconf("SC_PAGE_SIZE") * batch_size.os.sysconf("SC_PHYS_PAGES")
    memory, said = batch_size.device_memory()
    assert memory == host / 4 and "no GPU here" in said and "over 4 process(es)" in said


def test_the_help_offers_auto(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--per_device_train_batch_size PER_DEVICE_TRAIN_BATCH_SIZE sequences per process and micro-batch, or auto"
        in text
    )


def batch_flag(value: str) -> list[str]:
    """``--per_device_train_batch_size`` with ``value`` as typed: ``=4`` joined to the flag, else a word of its own."""
    flag = "--per_device_train_batch_size"
    return [flag + value] if value.startswith("=") else [flag, value]


@pytest.mark.parametrize("auto_last", [False, True], ids=["auto-first", "auto-last"])
@pytest.mark.parametrize("number", ["4", "1", "=4"])
@pytest.mark.parametrize("auto", ["auto", "AUTO", "=auto", "=Auto"])
def test_auto_and_a_number_given_twice_quote_what_was_typed(auto, number, auto_last, tmp_path):
    """The repeat check names the values the user typed (auto, not the placeholder 1 parsing puts in its place)."""
    flags = [*batch_flag(number), *batch_flag(auto)] if auto_last else [*batch_flag(auto), *batch_flag(number)]
    with pytest.raises(RecipeError) as err:
        parse_args([*flags, "--output_dir", str(tmp_path / "out"), "--allow_no_fsdp", "true"])
    typed = [auto.lstrip("="), number.lstrip("=")]
    first, second = reversed(typed) if auto_last else typed
    line = str(err.value)
    assert "\n" not in line and "given twice with different values" in line, line
    assert f"--per_device_train_batch_size {first} and --per_device_train_batch_size {second} " in line, line


@pytest.mark.parametrize("card", [80 * GiB, 8 * GiB])
@pytest.mark.parametrize("cap", [MAX_AUTO_BATCH, 7, 1])
def test_a_choice_the_cap_stopped_says_the_cap_was_reached(card, cap):
    tiny = model_shape(str(REPO / "assets" / "tiny-llama"))
    setup = Setup(strategy="FULL_SHARD", nproc_per_node=1, seq_len=64)
    line = batch_size.describe(choose(tiny, setup, card, cap=cap), setup, "this GPU's memory", cap)
    assert "\n" not in line and f"auto: {cap} sequence(s)" in line, line
    assert f"the cap of {cap} reached: auto chooses no larger batch" in line, line


@pytest.mark.parametrize("processes", [1, 2, 8])
@pytest.mark.parametrize("examples", [1, 10, 255, 256, 2047, 2048, 10**6])
def test_the_auto_line_says_when_the_training_set_is_smaller_than_a_batch(examples, processes):
    """The line a run prints once its training set is built: a batch larger than what each process gets in an epoch
    is said, with the numbers; otherwise the line is the choice's alone."""
    line = "per_device_train_batch_size auto: 256 sequence(s) of 64 tokens, ... (the cap of 256 reached: ...)"
    said = batch_size.with_examples(line, 256, examples, processes)
    assert said.startswith(line) and "\n" not in said
    if examples < 256 * processes:
        assert f"the training set has {examples:,} example(s), fewer than 256 x {processes} process(es)" in said, said
    else:
        assert said == line


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_liger_s_fused_loss_leaves_out_exactly_the_logits_term(name):
    """use_liger_kernel: the loss never holds the [tokens, vocab] logits, so a larger batch fits the same budget."""
    from fsdp_recipes.config.memory import LOGITS_PEAK_BYTES, activation_bytes

    shape, setup = SHAPES[name], Setup(strategy="FULL_SHARD", nproc_per_node=1, micro_batch=3, seq_len=1024)
    eager, fused = activation_bytes(shape, setup)[0], activation_bytes(shape, replace(setup, fused_loss=True))[0]
    assert eager - fused == 3 * 1024 * LOGITS_PEAK_BYTES * shape.vocab
    budget = estimate(shape, replace(setup, micro_batch=8)).gpu_total
    chosen = [choose(shape, replace(setup, fused_loss=f), budget / (1 - MARGIN)).batch for f in (False, True)]
    assert chosen[0] == 8 and chosen[1] > 8


def fake_liger(monkeypatch, families):
    """liger_kernel's table of the model families it patches, as the installed package would hold it."""
    import sys

    # Liger's apply_liger_kernel_to_llama and most
    def fuses(fused_linear_cross_entropy=True, rms_norm=True):
        pass

    # apply_liger_kernel_to_granite
    def does_not_by_default(fused_linear_cross_entropy=False, rms_norm=True):
        pass

    # apply_liger_kernel_to_pixtral
    def has_none(rms_norm=True):
        pass

    table = SimpleNamespace(
        MODEL_TYPE_TO_APPLY_LIGER_FN={
            **dict.fromkeys(families, fuses),
            "granite": does_not_by_default,
            "pixtral": has_none,
        }
    )
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, SimpleNamespace())
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", table)


@pytest.mark.parametrize(
    "installed, model_type, changes, fused",
    [
        (True, "llama", {"use_liger_kernel": True}, True),
        # use_liger_kernel off
        (True, "llama", {}, False),
        # no Liger kernels for the family: its logits are held
        (True, "gpt2", {"use_liger_kernel": True}, False),
        # a bare parameter count
        (True, None, {"use_liger_kernel": True}, False),
        (
            True,
            "llama",
            {"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": False}},
            False,
        ),
        (True, "llama", {"use_liger_kernel": True, "liger_kernel_config": {"rms_norm": False}}, True),
        # the Trainer's loss
        (True, "llama", {"use_liger_kernel": True, "label_smoothing_factor": 0.1}, False),
        (True, "llama", {"use_liger_kernel": True, "label_smoothing_factor": 0.0}, True),
        # its fused loss is off by default
        (True, "granite", {"use_liger_kernel": True}, False),
        (
            True,
            "granite",
            {"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}},
            True,
        ),
        # no fused loss at all
        (True, "pixtral", {"use_liger_kernel": True}, False),
        # not installed (the run refuses it before this)
        (False, "llama", {"use_liger_kernel": True}, False),
    ],
)
def test_the_loss_is_counted_fused_only_where_liger_fuses_it(installed, model_type, changes, fused, monkeypatch):
    if installed:
        fake_liger(monkeypatch, ["llama", "qwen3", "mistral"])
    else:
        # import fails as when missing
        monkeypatch.setitem(__import__("sys").modules, "liger_kernel", None)
    assert batch_size.liger_fuses_loss(model_type, training_args(1, **changes)) is fused


def test_an_auto_batch_with_liger_on_a_family_it_fuses_is_larger(tmp_path, monkeypatch):
    from transformers import GPT2Config

    fake_liger(monkeypatch, ["llama"])
    monkeypatch.setattr(batch_size, "device_memory", lambda: (2 * GiB, "2 GiB"))
    config = {"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 2}}
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=50257).save_pretrained(gpt2)
    llama = str(REPO / "assets" / "tiny-llama")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for model, grows in ((llama, True), (str(gpt2), False)):
        eager = batch_size.choose_for_run(model, config, training_args(1), 512)[0]
        liger = batch_size.choose_for_run(model, config, training_args(1, use_liger_kernel=True), 512)[0]
        assert (liger > eager) is grows and liger >= eager, (model, eager, liger)
