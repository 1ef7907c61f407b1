"""Findings of the hostile review, each refused in one line where it was accepted (or a traceback) before: LoRA
adapter configs whose numbers merge into NaN weights, worker counts that fork-bomb the machine, merge sizes that
are not sizes, YAML keys given twice, parameter counts beyond any model. In this process, fast; the bad values
are generated, and the shipped files that must still pass are walked."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from conftest import REPO

from fsdp_recipes.bounded import load_yaml
from fsdp_recipes.config.parse import load_recipe
from fsdp_recipes.errors import RecipeError, UnreadableFile

TOOLS = REPO / "tools"
SHIPPED_YAML = sorted(
    p
    for folder in ("accelerate_configs", "recipes")
    for p in (REPO / folder).rglob("*")
    if p.suffix in (".yaml", ".yml")
)


def cli(tool: str, argv: list[str]) -> int:
    """A tool's main(argv) in this process (argparse's exit is a SystemExit, returned as its code)."""
    spec = importlib.util.spec_from_file_location(f"{tool}_cli", TOOLS / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.main(argv)
    except SystemExit as stop:
        return stop.code


def one_line(text: str, prefix: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), text
    return lines[0]


# --- 4. YAML keys given twice ---------------------------------------------------------------------------------------


def test_every_shipped_yaml_loads():
    assert len(SHIPPED_YAML) >= 10 and any("recipes" in p.parts for p in SHIPPED_YAML)
    for path in SHIPPED_YAML:
        assert isinstance(load_yaml(path, "shipped file"), dict), path


def _key_lines(text: str, indent: bool) -> list[tuple[int, str]]:
    """(index, line) of each `key: value` line with a scalar value, at the top level or indented."""
    pattern = r"\s+[A-Za-z_][\w.-]*:\s*\S.*" if indent else r"[A-Za-z_][\w.-]*:\s*\S.*"
    return [
        (i, line)
        for i, line in enumerate(text.splitlines())
        if re.fullmatch(pattern, line) and not line.strip().startswith("#")
    ]


@pytest.mark.parametrize("path", SHIPPED_YAML, ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_key_given_twice_is_refused_at_any_level(path, tmp_path):
    """Each shipped file with one of its own keys repeated (a top-level one at the end, a nested one right after
    itself): refused, naming the key and both lines, where pyyaml took the last."""
    lines = path.read_text().splitlines()
    cases = []
    if top := _key_lines(path.read_text(), indent=False):
        i, line = top[0]
        cases.append(([*lines, line], line.split(":")[0], i + 1, len(lines) + 1))
    if nested := _key_lines(path.read_text(), indent=True):
        i, line = nested[0]
        cases.append(([*lines[: i + 1], line, *lines[i + 1 :]], line.split(":")[0].strip(), i + 1, i + 2))
    assert cases, path
    for text, key, first, second in cases:
        bad = tmp_path / path.name
        bad.write_text("\n".join(text) + "\n")
        with pytest.raises(UnreadableFile) as err:
            load_yaml(bad, "file")
        assert f"has the key {key!r} twice (lines {first} and {second})" in str(err.value), str(err.value)
        assert "\n" not in str(err.value)


def test_a_recipe_with_learning_rate_twice(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1.0e-4\nblock_size: 64\nlearning_rate: 3.0e-4\n")
    with pytest.raises(RecipeError, match=r"has the key 'learning_rate' twice \(lines 1 and 3\): keep one"):
        load_recipe(recipe)
    recipe.write_text("learning_rate: 1.0e-4\nblock_size: 64\n")
    assert load_recipe(recipe) == {"learning_rate": 1.0e-4, "block_size": 64}


def test_an_accelerate_config_with_num_processes_twice(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    text = (REPO / "accelerate_configs" / "zero3.yaml").read_text()
    config.write_text(text + "num_processes: 8\n")
    assert "num_processes:" in text  # the shipped config's own count, then 8
    assert cli("check_config", [str(config)]) == 1
    assert "has the key 'num_processes' twice" in capsys.readouterr().err
    config.write_text(text)
    assert cli("check_config", [str(config)]) == 0


def test_equal_keys_in_different_mappings_are_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("a:\n  x: 1\nb:\n  x: 2\nc: [{x: 1}, {x: 2}]\n")
    assert load_yaml(path, "file") == {"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]}
    path.write_text("c: [{x: 1, 'x': 2}]\n")  # a quoted key is the same key
    with pytest.raises(UnreadableFile, match="has the key 'x' twice"):
        load_yaml(path, "file")


# --- 2. worker processes bounded by the machine ---------------------------------------------------------------------


def _arguments_on(monkeypatch, cpus):
    """fsdp_recipes/config/values.py imported afresh (as another module) on a machine with ``cpus`` CPUs."""
    import os
    import sys

    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    spec = importlib.util.spec_from_file_location(
        "fsdp_recipes._values_probe", REPO / "fsdp_recipes" / "config" / "values.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cpus, bound", [(None, 64), (1, 64), (2, 64), (16, 64), (17, 68), (40, 160), (256, 1024)])
@pytest.mark.parametrize("field", ["dataloader_num_workers", "preprocessing_num_workers"])
def test_worker_counts_are_bounded_by_the_machine(monkeypatch, cpus, bound, field):
    arguments = _arguments_on(monkeypatch, cpus)
    assert arguments.value_problem(field, bound) is None
    for value in (bound + 1, 100000, arguments.MAX_COUNT):
        problem = arguments.value_problem(field, value)
        assert problem.startswith(f"{field}={value} is more than {bound}: "), problem
        assert f"at most {bound}: max(64, 4 x the {cpus or 1} CPUs of this machine)" in problem and "\n" not in problem


def test_a_fork_bomb_of_workers_is_refused_by_parse_args(tmp_path):
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.config.values import MAX_WORKERS

    for field in ("dataloader_num_workers", "preprocessing_num_workers"):
        with pytest.raises(RecipeError, match=rf"^{field}=100000 is more than {MAX_WORKERS}: .*CPUs of this machine"):
            parse_args([f"--{field}", "100000", "--output_dir", str(tmp_path / "o"), "--allow_no_fsdp", "true"])


# --- 3. merge_checkpoint.py sizes -----------------------------------------------------------------------------------

NOT_SIZES = [
    "0",
    "1",
    "-5",
    "5",
    "",
    "  ",
    "nanGB",
    "NaNMB",
    "infGB",
    "-infMB",
    "1e400GB",
    "fiveGB",
    "5XB",
    "GB",
    "5 G B",
]
NOT_POSITIVE = ["0KB", "-5GB", "-0.1MB", "0.0001KB"]  # 0.0001KB is 0 bytes as huggingface_hub reads it
SIZE_OPTIONS = {"--max-shard-size": ("100KB", "99.999KB", "5GB"), "--memory-budget": ("64MB", "63.9MB", "512MB")}


@pytest.mark.parametrize("option", sorted(SIZE_OPTIONS))
@pytest.mark.parametrize("value", [*NOT_SIZES, *NOT_POSITIVE, "below the minimum"])
def test_merge_sizes_that_are_not_sizes(option, value, tmp_path, capsys):
    """Each was a ValueError or OverflowError traceback, or taken (0KB: a shard per tensor; -5GB: every tensor
    read alone). Now argparse's exit 2 in one line naming the option and the value, before anything is read."""
    minimum, below, _ = SIZE_OPTIONS[option]
    value = below if value == "below the minimum" else value
    out = tmp_path / "out"
    assert cli("merge_checkpoint", [str(tmp_path / "ckpt"), str(out), f"{option}={value}"]) == 2
    line = one_line(capsys.readouterr().err, f"merge_checkpoint.py: error: argument {option}: {value!r} ")
    if value in NOT_POSITIVE:
        assert "is not positive: give at least" in line, line
    elif value == below:
        assert f"is below {minimum}: give at least {minimum}" in line, line
    else:
        assert "has no unit" in line or "is not a finite size" in line, line
    assert not out.exists()


@pytest.mark.parametrize("option", sorted(SIZE_OPTIONS))
def test_merge_sizes_from_the_minimum_up_are_taken(option, tmp_path, capsys):
    """The minimum, the default and a few spellings pass the parser: the run goes on to the input (missing here)."""
    minimum, _, default = SIZE_OPTIONS[option]
    for value in (minimum, default, default.lower(), f" {default} ", "1.5TB", "1e3GB"):
        assert cli("merge_checkpoint", [str(tmp_path / "missing"), str(tmp_path / "out"), f"{option}={value}"]) == 1
        assert "does not exist" in one_line(capsys.readouterr().err, "merge_checkpoint.py: error: ")


# --- 1. LoRA adapter configs ----------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
# key -> values that merged into NaN or wrong weights (or that peft cannot load), each refused naming the key
BAD_ADAPTER_VALUES = {
    "lora_alpha": [NAN, INF, -INF, -16, -0.5, 0, 0.0, 2**20 + 1, 1e300, "16", True, False, None, [16], {"a": 16}],
    "r": [10**12, 65537, 0, -1, 1.5, 8.0, NAN, INF, True, False, "8", None, [8]],
    "lora_dropout": [NAN, INF, -INF, -0.1, 1, 1.0, 1.5, "0.1", True, None, [0.1]],
    **{
        flag: ["false", "true", 0, 1, None, [], {}]
        for flag in ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias")
    },
    "peft_type": [1, None, ["LORA"], {}],
    "base_model_name_or_path": [5, ["base"], {"path": "base"}, True],
    "target_modules": [5, True, {"q_proj": 1}, [1, 2], ["q_proj", None]],
    "rank_pattern": [[], "q_proj", 8],
    "alpha_pattern": [[], "q_proj", 8],
    "modules_to_save": ["lm_head", 1, {}],
    "layer_replication": ["0-4", 1, {}],
}
GOOD_ADAPTER_VALUES = {  # the ends of each range, and what peft itself writes
    "lora_alpha": [1, 0.5, 1e-3, 16, 2**20, 32.0],
    "r": [1, 8, 65536],
    "lora_dropout": [0, 0.0, 0.05, 0.999],
    "use_rslora": [True, False],
    "fan_in_fan_out": [False, True],
    "use_dora": [False],
    "lora_bias": [False],
    "base_model_name_or_path": [None, "meta-llama/Llama-3.2-1B"],
    "target_modules": [None, "all-linear", ["q_proj"], []],
    "rank_pattern": [None, {}, {"q_proj": 4}],
    "alpha_pattern": [None, {}],
    "modules_to_save": [None, []],
    "layer_replication": [None, []],
}


def peft_adapter_config(tmp_path) -> dict:
    """The adapter_config.json peft itself writes for a plain LoRA (r 4, alpha 8)."""
    import json

    from peft import LoraConfig

    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]).save_pretrained(str(tmp_path / "peft"))
    return json.loads((tmp_path / "peft" / "adapter_config.json").read_text())


def write_adapter_config(folder: Path, config: dict) -> Path:
    import json

    path = folder / "adapter_config.json"
    path.write_text(json.dumps(config))  # NaN and Infinity as json writes (and reads) them
    return path


@pytest.mark.parametrize("key", sorted(BAD_ADAPTER_VALUES))
def test_adapter_config_values_that_cannot_merge_are_refused(key, tmp_path):
    from fsdp_recipes.ckpt.lora_merge import read_adapter_config
    from fsdp_recipes.errors import CheckpointError

    valid = peft_adapter_config(tmp_path)
    assert read_adapter_config(write_adapter_config(tmp_path, valid))["r"] == 4
    for value in BAD_ADAPTER_VALUES[key]:
        path = write_adapter_config(tmp_path, {**valid, key: value})
        with pytest.raises(CheckpointError) as err:
            read_adapter_config(path)
        message = str(err.value)
        assert message.startswith(f"{path}: {key} ") and "\n" not in message, (value, message)


@pytest.mark.parametrize("key", sorted(GOOD_ADAPTER_VALUES))
def test_adapter_config_values_peft_writes_are_taken(key, tmp_path):
    from fsdp_recipes.ckpt.lora_merge import read_adapter_config

    valid = peft_adapter_config(tmp_path)
    for value in GOOD_ADAPTER_VALUES[key]:
        assert read_adapter_config(write_adapter_config(tmp_path, {**valid, key: value}))[key] == value


@pytest.mark.parametrize("missing", [["r"], ["lora_alpha"], ["lora_alpha", "r"]])
def test_an_adapter_config_without_r_or_alpha(missing, tmp_path):
    from fsdp_recipes.ckpt.lora_merge import read_adapter_config
    from fsdp_recipes.errors import CheckpointError

    config = {k: v for k, v in peft_adapter_config(tmp_path).items() if k not in missing}
    with pytest.raises(CheckpointError, match=f"is not a LoRA adapter config \\(no {' and no '.join(missing)}\\)"):
        read_adapter_config(write_adapter_config(tmp_path, config))


class FakeSource:
    """A checkpoint source holding one LoRA-wrapped linear (out 3, in 5) of rank ``r``."""

    def __init__(self, r: int, scale: float = 1.0):
        import torch

        from fsdp_recipes.ckpt.readers import TensorInfo

        gen = torch.Generator().manual_seed(r)
        self.values = {
            "q.base_layer.weight": torch.randn(3, 5, generator=gen),
            "q.lora_A.default.weight": torch.randn(r, 5, generator=gen) * scale,
            "q.lora_B.default.weight": torch.randn(3, r, generator=gen) * scale,
            "norm.weight": torch.ones(5),
        }
        self.tensors = {n: TensorInfo(tuple(t.shape), "float32") for n, t in self.values.items()}
        self.ranks, self.kind = 1, "fake"

    def read(self, names):
        return {n: self.values[n] for n in names}


@pytest.mark.parametrize("rank", [1, 4])
def test_a_config_whose_r_is_not_the_adapters_is_refused(rank):
    import torch

    from fsdp_recipes.ckpt.lora_merge import MergedLoraSource
    from fsdp_recipes.errors import CheckpointError

    source = FakeSource(rank)
    config = {"r": rank, "lora_alpha": 8}
    merged = MergedLoraSource(source, config).read(["q.weight"])["q.weight"]
    v = source.values
    torch.testing.assert_close(
        merged, v["q.base_layer.weight"] + v["q.lora_B.default.weight"] @ v["q.lora_A.default.weight"] * (8 / rank)
    )
    for other in (rank + 1, 65536):
        with pytest.raises(
            CheckpointError, match=f"q.lora_A.default.weight has rank {rank} but adapter_config.json says r {other}"
        ):
            MergedLoraSource(source, {"r": other, "lora_alpha": 8})
    MergedLoraSource(
        source, {"r": rank + 1, "lora_alpha": 8, "rank_pattern": {"q": rank}}
    )  # per-module ranks: peft's own


def test_a_merge_that_overflows_is_refused_not_written():
    from fsdp_recipes.ckpt.lora_merge import MergedLoraSource
    from fsdp_recipes.errors import CheckpointError

    source = FakeSource(2, scale=1e20)  # B @ A about 1e40: beyond float32
    with pytest.raises(
        CheckpointError,
        match=r"^q.weight: merging lora_B @ lora_A x 4 into it gives values that are not finite in float32",
    ):
        MergedLoraSource(source, {"r": 2, "lora_alpha": 8}).read(["q.weight"])
    source = FakeSource(2)
    source.values["q.base_layer.weight"][0, 0] = float(
        "nan"
    )  # the checkpoint's own NaN: passed on as stored, not blamed on the merge
    merged = MergedLoraSource(source, {"r": 2, "lora_alpha": 8}).read(["q.weight"])["q.weight"]
    assert merged[0, 0].isnan() and merged.isfinite().sum() == merged.numel() - 1


def test_the_config_peft_writes_still_merges_as_merge_and_unload(tmp_path):
    """The checks take peft's own file: a peft model's whole state dict merges bit for bit as peft merges it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.ckpt.lora_merge import MergedLoraSource, read_adapter_config
    from fsdp_recipes.ckpt.readers import TensorInfo

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_rslora=True
    )
    model = get_peft_model(
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")), config
    )
    model.peft_config["default"].save_pretrained(str(tmp_path))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    source = FakeSource(1)
    source.values, source.tensors = state, {k: TensorInfo(tuple(v.shape), "float32") for k, v in state.items()}
    merged = MergedLoraSource(source, read_adapter_config(tmp_path / "adapter_config.json"))
    ours = merged.read(sorted(merged.tensors))
    by_peft = model.merge_and_unload().state_dict()
    assert len(by_peft) == len(ours) and all(torch.equal(ours[f"base_model.model.{k}"], v) for k, v in by_peft.items())


# --- 5. estimate_memory.py model sizes and paths --------------------------------------------------------------------

COUNT_PROBLEMS = {  # count -> what the message says is wrong
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
    for argv in forms:  # argparse took '-7B' for an option, then said the model was missing
        assert cli("estimate_memory", argv) == 2
        line = one_line(capsys.readouterr().err, f"estimate_memory.py: error: argument model: {count!r} ")
        assert COUNT_PROBLEMS[count] in line, (argv, line)


@pytest.mark.parametrize("text", ["7X", "13G", "1.5bn", "70 P", "3e9Q"])
def test_a_count_with_another_suffix_is_named_not_looked_up_on_the_hub(text, capsys):
    """(hostile review) '7X' went to the hub (no network: "couldn't connect to huggingface.co"); the suffix is the problem."""
    assert cli("estimate_memory", [text]) == 2
    line = one_line(
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
    """Each went to transformers (or to the hub as a repo id: '/dev/zero' was 'Repo id must be in the form ...')."""
    import os

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
        assert said in one_line(capsys.readouterr().err, "estimate_memory.py: error: "), model
    (empty / "my_config.json").write_text((REPO / "assets" / "tiny-llama" / "config.json").read_text())
    for model in (
        REPO / "assets" / "tiny-llama",
        REPO / "assets" / "tiny-llama" / "config.json",
        empty / "my_config.json",
    ):
        assert cli("estimate_memory", [str(model), "--json"]) == 0, model
        assert '"hidden": ' in capsys.readouterr().out


# --- session 9's review: the layout change and the issue-21 pieces -------------------------------------------------


def _run_with_checkpoint(run: Path) -> None:
    ckpt = run / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")


@pytest.mark.parametrize("missing", ["{other}/checkpoint-4", "{other}/not-there", ""])
def test_an_explicit_resume_path_that_is_not_a_folder_is_named_first(tmp_path, missing):
    """Before anything else judges output_dir: a typo in the path is named as a typo, not as another run's folder."""
    from fsdp_recipes.config.parse import parse_args

    _run_with_checkpoint(tmp_path / "a")
    path = missing.format(other=tmp_path / "aa")
    with pytest.raises(RecipeError, match=f"--resume_from_checkpoint {re.escape(repr(path))} is not a folder"):
        parse_args(["--allow_no_fsdp", "true", "--output_dir", str(tmp_path / "a"), "--resume_from_checkpoint", path])


def test_the_files_a_run_without_fsdp_writes_are_a_runs_files(tmp_path):
    """The Trainer's save_model (DDP, ZeRO-1, --allow_no_fsdp) writes training_args.bin beside the model: a resume into
    that output_dir must not call it someone else's file."""
    from fsdp_recipes.ckpt.layout import foreign_entries

    for name in (
        "training_args.bin",
        "model.safetensors",
        "config.json",
        "run_args.json",
        ".run.lock",
        ".run.lock.owner",
    ):
        (tmp_path / name).write_text("x")
    assert foreign_entries(tmp_path) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert foreign_entries(tmp_path) == ["notes.txt"]


def test_any_failure_of_rank_0s_resume_decision_becomes_its_error(tmp_path, monkeypatch):
    """Rank 0 alone decides: an exception there must travel to every rank as the decision's error, not leave the
    others waiting in the broadcast."""
    from fsdp_recipes.ckpt.resume import decide

    (tmp_path / "requeue_progress.json").write_text('{"step": 1e999, "stalled": 0}')
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    decision = decide(None, str(tmp_path))
    assert decision.path is None and decision.error and "the resume could not be decided" in decision.error
