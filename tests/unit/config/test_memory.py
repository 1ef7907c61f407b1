"""tools/estimate_memory.py: the ZeRO reference points, and agreement with the bytes real FSDP runs hold per rank."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
from conftest import ALL_CONFIGS, REPO, cli, one_line_error, run
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.config.memory import GiB, ModelShape, Setup, estimate, fitting_configs, model_shape, parse_count

TOOL = str(REPO / "tools" / "estimate_memory.py")
TINY = str(REPO / "assets" / "tiny-llama")


def states(est) -> float:
    return est.params + est.grads + est.optimizer


@pytest.mark.parametrize(
    "params, nproc, nnodes, strategy, expected",
    [
        # 16 bytes x 7e9, on every GPU
        ("7B", 4, 1, "NO_SHARD", 112e9),
        # 16 x 7e9 / 4
        ("7B", 4, 1, "FULL_SHARD", 28e9),
        # shard group = 8 GPUs of a node
        ("7B", 8, 2, "HYBRID_SHARD", 14e9),
    ],
)
def test_zero_reference_points(params, nproc, nnodes, strategy, expected):
    est = estimate(
        ModelShape(params=parse_count(params)), Setup(strategy=strategy, nproc_per_node=nproc, nnodes=nnodes)
    )
    assert states(est) == pytest.approx(expected)


def test_175b_on_64_gpus_is_about_41_gib():
    est = estimate(ModelShape(params=parse_count("175B")), Setup(strategy="FULL_SHARD", nproc_per_node=8, nnodes=8))
    assert states(est) / GiB == pytest.approx(41, abs=0.5)


def test_strategy_extras_and_offload():
    shape = ModelShape(params=int(1e9), hidden=2048, layers=16, vocab=32000, largest_unit=int(65.5e6))
    full = estimate(shape, Setup(strategy="FULL_SHARD", nproc_per_node=8))
    zero2 = estimate(shape, Setup(strategy="SHARD_GRAD_OP", nproc_per_node=8))
    # bf16 parameters kept from forward to backward
    assert zero2.gathered_params == 2e9 and full.gathered_params == 0
    # autocast's bf16 copies of the fp32 weights, saved for backward; none in fp32
    for replicated in ("DDP", "ZERO1"):
        assert estimate(shape, Setup(strategy=replicated, nproc_per_node=8)).gathered_params == 2e9
        assert estimate(shape, Setup(strategy=replicated, nproc_per_node=8, precision="fp32")).gathered_params == 0
    assert full.all_gather_working_set == 2 * 65.5e6 * 2
    offload = estimate(shape, Setup(strategy="FULL_SHARD", nproc_per_node=8, offload=True))
    assert states(offload) == 0 and offload.cpu_offload_per_node == pytest.approx(16e9)
    ckpt = estimate(shape, Setup(activation_checkpointing=True, micro_batch=4))
    plain = estimate(shape, Setup(activation_checkpointing=False, micro_batch=4))
    # the loss's three fp32 tensors over the logits, the final norm: unaffected by checkpointing
    logits = 2048 * 4 * (12 * 32000 + 8 * 2048)
    sbh = 2048 * 4 * 2048
    # a shape without its MLP: the GPT formula, every layer's 34 sbh bytes kept
    assert plain.activations - logits == 34 * sbh * 16
    # each layer's input, plus one layer recomputed
    assert ckpt.activations - logits == 2 * sbh * 16 + 34 * sbh


def test_model_shape_from_a_config_matches_the_real_model():
    shape = model_shape(TINY)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    assert shape.params == sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    embedding = model.get_input_embeddings().weight.numel()
    # a decoder layer beats the 474 x 64 embedding
    assert shape.largest_unit == max(layer, embedding) == 45440


def test_gpu_memory_lists_shipped_configs_cheapest_first():
    shape = ModelShape(params=int(7e9))
    rows = fitting_configs(shape, Setup(nproc_per_node=8), 80 * GiB)
    assert [r[0] for r in rows] == [
        "ddp.yaml",
        "fsdp1/no_shard.yaml",
        "ddp.yaml --zero1 true",
        "zero2.yaml",
        "hybrid_shard.yaml",
        "zero3.yaml",
        "zero3_offload.yaml",
    ]
    assert [r[2] for r in rows] == [False, False, True, True, True, True, True]
    for config, _, _ in rows:
        assert f"accelerate_configs/{config.split()[0]}" in ALL_CONFIGS


def test_gpu_memory_lists_each_config_as_it_runs_on_one_process():
    """On one process every FSDP1 config is NO_SHARD (torch switches), the FSDP2 HSDP config cannot run, and the
    table agrees with the estimate of each config it names."""
    from fsdp_recipes.config.strategy import shipped_configs

    shape = ModelShape(params=int(1e9), hidden=2048, layers=16, vocab=32000, largest_unit=int(65.5e6))
    setup = Setup(nproc_per_node=1, micro_batch=4, seq_len=1024)
    rows = fitting_configs(shape, setup, 5.9 * GiB)
    assert [r[0] for r in rows] == [
        "ddp.yaml",
        "fsdp1/no_shard.yaml",
        "fsdp1/zero3_offload.yaml",
        "ddp.yaml --zero1 true",
        "zero2.yaml",
        "zero3.yaml",
        "zero3_offload.yaml",
    ]
    configs = shipped_configs()
    for label, need, fits in rows:
        strategy = configs[label]
        name = "ZERO1" if "--zero1" in label else strategy.memory_strategy_on(1, 1)
        assert (
            need
            == estimate(shape, Setup(**{**setup.__dict__, "strategy": name, "offload": strategy.offload})).gpu_total
        )
        assert fits == (need <= 5.9 * GiB)
    # NO_SHARD + offload fits where FULL_SHARD + offload did not
    assert {r[0]: r[2] for r in rows}["fsdp1/zero3_offload.yaml"]
    assert not {r[0]: r[2] for r in rows}["zero3_offload.yaml"]
    assert "hybrid_shard.yaml" in [r[0] for r in fitting_configs(shape, Setup(nproc_per_node=2, nnodes=2), 80 * GiB)]


def test_zero1_shards_only_the_optimizer_state():
    shape = ModelShape(params=int(7e9))
    ddp, zero1 = (estimate(shape, Setup(strategy=s, nproc_per_node=8)) for s in ("DDP", "ZERO1"))
    # 16P on every GPU
    assert (ddp.params, ddp.grads, ddp.optimizer) == (28e9, 28e9, 56e9)
    # 8P + 8P/N
    assert (zero1.params, zero1.grads, zero1.optimizer) == (28e9, 28e9, 7e9)
    assert zero1.all_gather_working_set == ddp.all_gather_working_set == 0
    with pytest.raises(ValueError, match="offload is an FSDP setting"):
        estimate(shape, Setup(strategy="ZERO1", offload=True))


def test_cli_text_and_json(capsys):
    """One run as a command (the entry point), the rest through its main() in this process."""
    proc = run(
        ["python", TOOL, "7B", "--nproc-per-node", "4", "--strategy", "FULL_SHARD", "--gpu-memory", "80GiB", "--json"]
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    per_gpu = data["per_gpu_bytes"]
    assert per_gpu["params"] + per_gpu["grads"] + per_gpu["optimizer"] == pytest.approx(28e9)
    assert [c["config"] for c in data["configs"]][0] == "ddp.yaml"
    spec = importlib.util.spec_from_file_location("estimate_memory_cli", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([TINY, "--config", str(REPO / "accelerate_configs" / "zero2.yaml"), "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "SHARD_GRAD_OP" in out and "activations" in out
    # FSDP1 on one process runs NO_SHARD whatever its config names (torch switches): the estimate says so
    for name in ("fsdp1/zero2.yaml", "fsdp1/zero3.yaml", "fsdp1/hybrid_shard.yaml"):
        assert tool.main([TINY, "--config", str(REPO / "accelerate_configs" / name), "--nproc-per-node", "1"]) == 0
        out = capsys.readouterr().out
        assert (
            "NO_SHARD" in out.splitlines()[0] and "note: FSDP1 in a shard group of one process runs NO_SHARD" in out
        ), name
    assert tool.main([TINY, "--config", str(REPO / "accelerate_configs" / "zero2.yaml"), "--nproc-per-node", "1"]) == 0
    out = capsys.readouterr().out
    # FSDP2 keeps it on one process
    assert "SHARD_GRAD_OP" in out.splitlines()[0] and "runs NO_SHARD" not in out
    with pytest.raises(SystemExit) as stop:
        tool.main(["--help"])
    assert stop.value.code == 0 and "16 bytes per parameter" in capsys.readouterr().out
    assert tool.main(["seven billion"]) == 1 and capsys.readouterr().err.startswith("estimate_memory.py: error:")


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_estimate_within_5_percent_of_measured_bytes(trained, config):
    """The training runs record each rank's bytes of parameters, gradients and optimizer state after step 1."""
    from bench.estimate_calibration import cpu_setup

    run_ = trained(config)
    report = run_.report
    setup, _ = cpu_setup(config, run_.world_size)
    est = estimate(model_shape(TINY), setup)
    for rank in report["ranks"]:
        measured = rank["bytes"]
        assert measured["params"] == pytest.approx(est.params, rel=0.05)
        assert measured["grads"] == pytest.approx(est.grads, rel=0.05)
        assert measured["optimizer"] == pytest.approx(est.optimizer, rel=0.05)


# count -> what the message says is wrong
COUNT_PROBLEMS = {
    **dict.fromkeys(
        ("9999999999999999999999999B", "101T", "1e15", "100000000000001", "1e6T", "100000001M"),
        "is not the size of any model: ",
    ),
    **dict.fromkeys(("-7B", "-7", "-0.5M", "-1e3", "-100T", "-1"), "is not a parameter count: it is negative"),
    **dict.fromkeys(("nan", "NaN", "inf", "-inf", "infinity", "1e999B", "-1e999"), "is not a finite number"),
    **dict.fromkeys(("0", "0B", "0.5", ".5", "1e-3"), "is not a parameter count: it is less than 1"),
}


@pytest.mark.parametrize("count", sorted(COUNT_PROBLEMS))
def test_parameter_counts_beyond_any_model_or_below_one(count, capsys):
    from fsdp_recipes.config.memory import parse_count

    with pytest.raises(ValueError, match=re.escape(COUNT_PROBLEMS[count])):
        parse_count(count)
    forms = [[count], ["--", count], [count, "--nproc-per-node", "2"]] if count.startswith("-") else [[count]]
    # a negative count is the model argument, not an option argparse does not know
    for argv in forms:
        assert cli("estimate_memory", argv) == 2
        line = one_line_error(capsys.readouterr().err, f"estimate_memory.py: error: argument model: {count!r} ")
        assert COUNT_PROBLEMS[count] in line, (argv, line)


@pytest.mark.parametrize("text", ["7X", "13G", "1.5bn", "70 P", "3e9Q"])
def test_a_count_with_another_suffix_is_named_not_looked_up_on_the_hub(text, capsys):
    """A count with a suffix other than K, M, B or T ('7X') is named as such, not looked up on the hub as a model id."""
    assert cli("estimate_memory", [text]) == 2
    line = one_line_error(
        capsys.readouterr().err,
        f"estimate_memory.py: error: argument model: {text!r} is not a parameter count: its suffix ",
    )
    assert "is not K, M, B or T" in line and "huggingface" not in line, line


@pytest.mark.parametrize(
    "count, params",
    [
        ("1", 1),
        ("7B", 7 * 10**9),
        ("100T", 10**14),
        ("1e14", 10**14),
        ("+7B", 7 * 10**9),
        ("7e-3B", 7 * 10**6),
        ("1.5e9", 1_500_000_000),
        (" 350m ", 350 * 10**6),
    ],
)
def test_parameter_counts_up_to_100t_are_taken(count, params, capsys):
    from fsdp_recipes.config.memory import parse_count

    assert parse_count(count) == params
    assert cli("estimate_memory", [count, "--json"]) == 0
    assert f'"params": {params}' in capsys.readouterr().out


def test_a_model_path_that_is_not_a_model_config(tmp_path, capsys):
    """A device, a FIFO, a file that is not JSON, a folder without config.json or a missing path is one line saying
    which, never handed to transformers or to the hub as a repo id; a folder, its config.json or another JSON file
    of a config is read."""
    fifo, junk, empty = tmp_path / "fifo", tmp_path / "junk.json", tmp_path / "empty"
    os.mkfifo(fifo)
    junk.write_text("not json")
    empty.mkdir()
    cases = {
        "/dev/zero": "model config '/dev/zero' is a character device, not a file",
        str(fifo): f"model config {str(fifo)!r} is a FIFO (named pipe), not a file",
        str(junk): f"model config {str(junk)!r} is not valid JSON",
        str(empty): f"model folder {str(empty)!r} holds no config.json",
        str(tmp_path / "missing"): f"model config {str(tmp_path / 'missing')!r} does not exist",
        "./no-such-model": "model config './no-such-model' does not exist",
    }
    for model, said in cases.items():
        assert cli("estimate_memory", [model]) == 1
        assert said in one_line_error(capsys.readouterr().err, "estimate_memory.py: error: "), model
    (empty / "my_config.json").write_text((REPO / "assets" / "tiny-llama" / "config.json").read_text())
    for model in (
        REPO / "assets" / "tiny-llama",
        REPO / "assets" / "tiny-llama" / "config.json",
        empty / "my_config.json",
    ):
        assert cli("estimate_memory", [str(model), "--json"]) == 0, model
        assert '"hidden": ' in capsys.readouterr().out


@pytest.mark.parametrize(
    "given",
    ["recipes/tiny-llama/lora_sft.yaml", "accelerate_configs/torchrun/zero3.json", "empty", "a key: value"],
)
def test_a_file_that_is_no_accelerate_config_is_refused_not_estimated(tmp_path, given, capsys):
    """--config with a recipe, the torchrun route's fsdp_config JSON or an empty file: no distributed_type, so
    accelerate's defaults (FSDP1 FULL_SHARD, fp32) would be estimated as if the file had said them. One line, exit 1."""
    path = REPO / given if "/" in given else tmp_path / "config.yaml"
    if "/" not in given:
        path.write_text("" if given == "empty" else given + "\n")
    assert cli("estimate_memory", ["7B", "--config", str(path)]) == 1
    line = one_line_error(capsys.readouterr().err, f"estimate_memory.py: error: accelerate config '{path}' ")
    assert "no distributed_type" in line and "accelerate_configs/zero3.yaml" in line, line


def _sized(folder, config: dict, key: str, value):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    return str(folder)


LLAMA_SIZES = ["hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads"]
GPT2_SIZES = ["n_embd", "n_head", "vocab_size", "n_inner"]
SIZE_CASES = (
    [("llama", key, value) for key in LLAMA_SIZES for value in (0, -8)]
    + [("llama", "head_dim", 0), ("llama", "hidden_size", "64"), ("llama", "hidden_size", 64.5)]
    + [("llama", "hidden_size", True), ("llama", "hidden_size", [64])]
    + [("gpt2", key, value) for key in GPT2_SIZES for value in (0, -1)]
)


@pytest.mark.parametrize("family, key, value", SIZE_CASES)
def test_a_model_of_no_width_is_refused_in_one_line_not_estimated(tmp_path, capsys, family, key, value):
    """A config whose width, heads or vocabulary is 0, negative or no whole number builds a model of 0 parameters
    (or a traceback): estimate_memory.py said 0 bytes for it. Refused by name, where the layer counts are."""
    from transformers import GPT2Config

    from fsdp_recipes.config.model_source import config_size_problem

    base = json.loads((REPO / "assets" / "tiny-llama" / "config.json").read_text())
    if family == "gpt2":
        base = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128).to_dict()
    folder = _sized(tmp_path / "model", base, key, value)
    assert cli("estimate_memory", [folder]) == 1
    line = one_line_error(capsys.readouterr().err, f"estimate_memory.py: error: {folder} has {key}: {value!r} ")
    assert "whole numbers of at least 1" in line, line
    assert config_size_problem(folder)[0].startswith(f"has {key}: {value!r} in its config.json")
    # GPT-2's n_inner and Llama's head_dim may be null (derived from the width): taken
    taken = _sized(tmp_path / "null", base, "n_inner" if family == "gpt2" else "head_dim", None)
    assert config_size_problem(taken) is None
