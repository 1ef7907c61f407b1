"""tools/check_config.py: every shipped config and recipe passes; each rule rejects its broken config."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import yaml
from conftest import ALL_CONFIGS, REPO, cli, elastic_root_cause, free_port, run

from fsdp_recipes.config.accelerate_config import check_config, check_settings
from fsdp_recipes.config.problems import errors

RECIPES = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.yaml"))
TINY = str(REPO / "assets" / "tiny-llama")
FSDP2 = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
FSDP1 = yaml.safe_load((REPO / "accelerate_configs" / "fsdp1" / "zero3.yaml").read_text())


@pytest.mark.parametrize("config", ALL_CONFIGS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_shipped_configs_and_recipes_pass(config, recipe):
    problems = check_config(REPO / config, REPO / recipe, model=TINY)
    assert not errors(problems), [str(p) for p in problems]


def variant(base: dict, drop=(), **changes) -> dict:
    cfg = json.loads(json.dumps(base))
    for key, value in changes.items():
        if key.startswith("fsdp_"):
            cfg["fsdp_config"][key] = value
        else:
            cfg[key] = value
    for key in drop:
        cfg["fsdp_config"].pop(key, None) if key.startswith("fsdp_") else cfg.pop(key, None)
    return cfg


LARGE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 32000,
}

# (case, config, recipe, model, level, key, text in the message or fix)
CASES = [
    (
        "typo top-level key",
        {**FSDP2, "mixed_precison": "bf16"},
        {},
        None,
        "error",
        "mixed_precison",
        "did you mean mixed_precision?",
    ),
    (
        "typo fsdp key",
        variant(FSDP1, fsdp_sharding_stratgy="FULL_SHARD"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_sharding_stratgy",
        "did you mean fsdp_sharding_strategy?",
    ),
    (
        "unknown parallelism key",
        {**FSDP2, "parallelism_config": {"parallelism_config_dp_shrad_size": 2}},
        {},
        None,
        "error",
        "parallelism_config.parallelism_config_dp_shrad_size",
        "did you mean parallelism_config_dp_shard_size?",
    ),
    (
        "bad strategy name",
        variant(FSDP1, fsdp_sharding_strategy="FULL_SHARDED"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_sharding_strategy",
        "did you mean FULL_SHARD?",
    ),
    (
        "legacy integer strategy",
        variant(FSDP1, fsdp_sharding_strategy=2),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_sharding_strategy",
        "legacy integer 2 means SHARD_GRAD_OP",
    ),
    (
        "integer strategy out of range",
        variant(FSDP1, fsdp_sharding_strategy=9),
        {},
        None,
        "error",
        "fsdp_config.fsdp_sharding_strategy",
        "integer 9 is not 1-5",
    ),
    (
        "bad prefetch",
        variant(FSDP1, fsdp_backward_prefetch="BACKWARDS_PRE"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_backward_prefetch",
        "is not one of BACKWARD_PRE",
    ),
    (
        "bad state dict type",
        variant(FSDP2, fsdp_state_dict_type="SHARDED"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_state_dict_type",
        "did you mean SHARDED_STATE_DICT?",
    ),
    (
        "LOCAL_STATE_DICT under FSDP2",
        variant(FSDP2, fsdp_state_dict_type="LOCAL_STATE_DICT"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_state_dict_type",
        "does not exist in FSDP2",
    ),
    (
        "bad mixed precision",
        {**FSDP2, "mixed_precision": "bfloat16"},
        {},
        None,
        "error",
        "mixed_precision",
        "is not one of no, fp16, bf16, fp8",
    ),
    (
        "bad boolean",
        variant(FSDP2, fsdp_offload_params="yes"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_offload_params",
        "is not true or false",
    ),
    (
        "number as words",
        variant(
            FSDP2,
            fsdp_auto_wrap_policy="SIZE_BASED_WRAP",
            fsdp_min_num_params="ten million",
            drop=("fsdp_transformer_layer_cls_to_wrap",),
        ),
        {},
        None,
        "error",
        "fsdp_config.fsdp_min_num_params",
        "'ten million' is not a non-negative integer",
    ),
    (
        "missing fsdp_version",
        variant(FSDP2, drop=("fsdp_version",)),
        {},
        None,
        "error",
        "fsdp_config.fsdp_version",
        "defaults to FSDP1",
    ),
    (
        "FSDP1 key under version 2",
        variant(FSDP2, fsdp_sharding_strategy="FULL_SHARD"),
        {},
        None,
        "error",
        "fsdp_config.fsdp_sharding_strategy",
        "FSDP1 setting; fsdp_version: 2 ignores it",
    ),
    (
        "FSDP2 key under version 1",
        variant(FSDP1, fsdp_reshard_after_forward=True),
        {},
        None,
        "error",
        "fsdp_config.fsdp_reshard_after_forward",
        "FSDP2 setting under fsdp_version: 1",
    ),
    (
        "ram-efficient loading without sync",
        variant(FSDP1, fsdp_sync_module_states=False),
        {},
        None,
        "error",
        "fsdp_config.fsdp_cpu_ram_efficient_loading",
        "needs fsdp_sync_module_states: true",
    ),
    (
        "double activation checkpointing",
        variant(FSDP2, fsdp_activation_checkpointing=True),
        {"gradient_checkpointing": True},
        None,
        "error",
        "gradient_checkpointing",
        "checkpointed twice",
    ),
    (
        "bf16 master weights and optimizer state",
        FSDP2,
        {"dtype": "bfloat16"},
        None,
        "warning",
        "dtype",
        "keeps the master weights and the optimizer state in 16 bits",
    ),
    (
        "QLoRA uint8 storage under FSDP2",
        FSDP2,
        {"load_in_4bit": True, "bnb_4bit_quant_storage": "uint8", "dtype": "bfloat16"},
        None,
        "error",
        "bnb_4bit_quant_storage",
        "uint8 storage under FSDP2",
    ),
    (
        "QLoRA storage unlike the other parameters",
        FSDP1,
        {"load_in_4bit": True, "bnb_4bit_quant_storage": "float16", "dtype": "bfloat16"},
        None,
        "error",
        "bnb_4bit_quant_storage",
        "float16 differs from the other parameters' dtype bfloat16",
    ),
    (
        "an optimizer that cannot step DTensors under FSDP2",
        FSDP2,
        {"optim": "adafactor"},
        None,
        "error",
        "optim",
        "cannot step FSDP2's sharded (DTensor) parameters",
    ),
    (
        "save_only_model (its checkpoints cannot resume a run)",
        FSDP2,
        {"save_only_model": True},
        None,
        "error",
        "save_only_model",
        "so they cannot resume a run",
    ),
    (
        "wrap class the model lacks",
        variant(FSDP2, fsdp_transformer_layer_cls_to_wrap="GPT2Block"),
        {},
        TINY,
        "error",
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
        "use LlamaDecoderLayer",
    ),
    (
        "processes do not split over machines",
        {**FSDP2, "num_processes": 3, "num_machines": 2},
        {},
        None,
        "error",
        "num_processes",
        "do not split evenly over 2 machines",
    ),
    (
        "machine rank out of range",
        {**FSDP2, "num_processes": 4, "num_machines": 2, "machine_rank": 2},
        {},
        None,
        "error",
        "machine_rank",
        "is not in 0..1",
    ),
    (
        "HSDP mesh does not fit",
        {
            **FSDP2,
            "num_processes": 8,
            "num_machines": 2,
            "parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2},
        },
        {},
        None,
        "error",
        "parallelism_config",
        "is not num_processes 8",
    ),
    (
        "FSDP1 HYBRID_SHARD on one machine",
        variant(FSDP1, fsdp_sharding_strategy="HYBRID_SHARD"),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_sharding_strategy",
        "behaves as FULL_SHARD",
    ),
    (
        "FSDP1 HYBRID_SHARD_ZERO2 on one machine",
        variant(FSDP1, fsdp_sharding_strategy="HYBRID_SHARD_ZERO2"),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_sharding_strategy",
        "behaves as SHARD_GRAD_OP",
    ),
    (
        "FSDP1 HYBRID_SHARD with one process per machine",
        variant(FSDP1, fsdp_sharding_strategy="HYBRID_SHARD", num_processes=4, num_machines=4),
        {},
        None,
        "error",
        "fsdp_config.fsdp_sharding_strategy",
        "would train every machine alone",
    ),
    (
        "distributed type not FSDP",
        {**FSDP2, "distributed_type": "MULTI_GPU"},
        {},
        None,
        "error",
        "distributed_type",
        "carries fsdp_config, which is then ignored",
    ),
    (
        "mixed precision in two places",
        FSDP2,
        {"fp16": True},
        None,
        "error",
        "fp16",
        "disagrees with the accelerate config's mixed_precision: bf16",
    ),
    (
        "cpu_bf16 without bf16",
        {**FSDP2, "mixed_precision": "no"},
        {"cpu_bf16": True},
        None,
        "error",
        "cpu_bf16",
        "keeps bf16 mixed precision on a CPU without native bf16, and mixed_precision is no",
    ),
    (
        "offload costs",
        variant(FSDP2, fsdp_offload_params=True),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_offload_params",
        "several times slower",
    ),
    (
        "BACKWARD_POST",
        variant(FSDP1, fsdp_backward_prefetch="BACKWARD_POST"),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_backward_prefetch",
        "overlaps less",
    ),
    ("fp16", {**FSDP2, "mixed_precision": "fp16"}, {}, None, "warning", "mixed_precision", "fp16 with FSDP"),
    (
        "ignored key",
        variant(FSDP2, fsdp_min_num_params=1000),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_min_num_params",
        "ignored: the wrap policy is TRANSFORMER_BASED_WRAP",
    ),
    (
        "FSDP1 FULL_STATE_DICT with use_orig_params",
        variant(FSDP1, fsdp_state_dict_type="FULL_STATE_DICT"),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_state_dict_type",
        "do not resume exactly",
    ),
    (
        "FSDP1 without a state-dict type (accelerate's default: FULL)",
        variant(FSDP1, drop=("fsdp_state_dict_type",)),
        {},
        None,
        "warning",
        "fsdp_config.fsdp_state_dict_type",
        "do not resume exactly",
    ),
    (
        "FULL_STATE_DICT on a large model",
        variant(FSDP2, fsdp_state_dict_type="FULL_STATE_DICT"),
        {},
        "LARGE",
        "warning",
        "fsdp_config.fsdp_state_dict_type",
        "gathers all 6.7B parameters",
    ),
]


@pytest.mark.parametrize("case, config, recipe, model, level, key, text", CASES, ids=[c[0] for c in CASES])
def test_each_rule(tmp_path, case, config, recipe, model, level, key, text):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    if model == "LARGE":
        (tmp_path / "large").mkdir()
        (tmp_path / "large" / "config.json").write_text(json.dumps(LARGE))
        model = str(tmp_path / "large" / "config.json")
    problems = check_config(path, recipe=recipe, model=model)
    hits = [p for p in problems if p.key == key and p.level == level and text in f"{p.message}; fix: {p.fix}"]
    assert hits, [str(p) for p in problems]
    if level == "warning":
        assert not errors(problems), [str(p) for p in problems]


def test_all_problems_at_once_through_the_cli(tmp_path, capsys):
    """tools/check_config.py's main (the docs' commands run the script itself: tests/integration/
    test_docs_commands.py)."""
    broken = variant(FSDP1, fsdp_sync_module_states=False, fsdp_backward_prefetch="SOON")
    broken["mixed_precison"] = "bf16"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    assert cli("check_config", [str(path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"error: {path}: ") for line in lines), lines
    assert cli("check_config", [str(REPO / c) for c in ALL_CONFIGS]) == 0, capsys.readouterr().err


def test_launch_flags_override_the_file_and_are_named_in_the_problem(tmp_path, monkeypatch):
    """accelerate launch's flags override its config file's keys: the settings in force are checked, and a problem
    a flag caused names the flag; without --config_file accelerate's default config is the file."""
    from fsdp_recipes.config import launcher

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config = tmp_path / "zero3.yaml"
    config.write_text(yaml.safe_dump(FSDP2))
    settings = launcher.from_launch_args(
        [
            "--config_file",
            "zero3.yaml",
            "--num_processes",
            "3",
            "--num_machines",
            "2",
            "--fsdp_reshard_after_forward",
            "false",
            "train_fsdp.py",
        ],
        tmp_path,
    )
    assert settings.config_file == config and settings.config["fsdp_config"]["fsdp_reshard_after_forward"] == "false"
    # the file's, untouched
    assert settings.config["fsdp_config"]["fsdp_version"] == FSDP2["fsdp_config"]["fsdp_version"]
    problems = errors(launcher.check(settings, {}, None))
    assert [(p.file, p.key) for p in problems] == [("accelerate launch", "--num_processes")], problems
    assert "3 processes do not split evenly over 2 machines" in problems[0].message
    assert (
        settings.describe()
        == f"{config} + accelerate launch (--fsdp_reshard_after_forward, --num_machines, --num_processes)"
    )

    ignored = launcher.from_launch_args(
        ["--config_file", str(config), "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "x.py"], tmp_path
    )
    # FSDP2 would silently keep FULL_SHARD
    [problem] = errors(launcher.check(ignored, {}, None))
    assert (problem.key, problem.message) == (
        "--fsdp_sharding_strategy",
        "is an FSDP1 setting; fsdp_version: 2 ignores it",
    )

    # `accelerate launch x.py`, no --config_file
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(yaml.safe_dump(variant(FSDP2, fsdp_offload_param=True)))
    settings = launcher.from_launch_args(["x.py"], tmp_path)
    [problem] = errors(launcher.check(settings, {}, None))
    assert (settings.config_file, problem.file, problem.key) == (
        default,
        str(default),
        "fsdp_config.fsdp_offload_param",
    )

    # flags only: accelerate's defaults, and the missing fsdp_version named as the flag to add
    default.unlink()
    settings = launcher.from_launch_args(["--use_fsdp", "--num_processes", "2", "x.py"], tmp_path)
    [problem] = errors(launcher.check(settings, {}, None))
    assert (settings.config_file, problem.file, problem.key) == (None, "accelerate launch", "--fsdp_version")


def test_fsdp_variables_of_other_launchers_are_checked():
    """torchrun or srun with ACCELERATE_USE_FSDP=true: the FSDP_* variables are the settings, named in problems.
    Under accelerate launch (which writes every variable with defaults) its command line is read instead."""
    from fsdp_recipes.config import launcher

    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    }
    settings = launcher.from_environment(env)
    assert settings.config["num_processes"] == 4 and settings.config["num_machines"] == 2
    assert settings.config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    problems = errors(launcher.check(settings, {}, TINY))
    assert [(p.file, p.key) for p in problems] == [("environment", "FSDP_SHARDING_STRATEGY")], problems
    fixed = {k: v for k, v in env.items() if k != "FSDP_SHARDING_STRATEGY"}
    assert not errors(launcher.check(launcher.from_environment(fixed), {}, TINY))
    wrong_class = launcher.check(
        launcher.from_environment({**fixed, "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block"}), {}, TINY
    )
    assert [(p.file, p.key) for p in errors(wrong_class)] == [("environment", "FSDP_TRANSFORMER_CLS_TO_WRAP")], (
        wrong_class
    )
    assert launcher.from_environment({**env, "ACCELERATE_DYNAMO_BACKEND": "NO"}) is None
    assert launcher.from_environment({"WORLD_SIZE": "2"}) is None


def test_more_gpus_than_processes_is_a_warning_with_the_flag(monkeypatch):
    from fsdp_recipes.config.launcher import unused_accelerators_warning

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "this node has 8 GPUs and this launch uses 2 of them: pass --num_processes 8" in unused_accelerators_warning(
        devices=8
    )
    assert unused_accelerators_warning(devices=2) is None and unused_accelerators_warning(devices=0) is None


@pytest.mark.slow
def test_train_fsdp_runs_the_check_before_anything_loads(tmp_path):
    """A typo accelerate itself would silently ignore (offload never happens), in the --config_file or in
    accelerate's default config, and a launch flag FSDP2 ignores: every rank stops in seconds, one line per machine,
    and that line is also the root cause the launcher's failure report ends with."""
    config = tmp_path / "copied.yaml"
    config.write_text(yaml.safe_dump(variant(FSDP2, fsdp_offload_param=True)))
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(config.read_text())
    typo = (
        "fsdp_config.fsdp_offload_param: unknown key (accelerate would silently ignore it); fix: did you "
        "mean fsdp_offload_params?"
    )
    out = tmp_path / "out"
    port = ["--main_process_port", str(free_port())]
    launches = [
        (
            ["--config_file", str(config), *port, "--fsdp_sharding_strategy", "SHARD_GRAD_OP"],
            [f"{config}: {typo}", "accelerate launch: --fsdp_sharding_strategy: is an FSDP1 setting"],
        ),
        # no --config_file: accelerate's default config
        (port, [f"{default}: {typo}"]),
    ]
    for launch_args, wanted in launches:
        proc = run(
            ["accelerate", "launch", *launch_args, str(REPO / "train_fsdp.py"), "--output_dir", str(out)],
            env={"HF_HOME": str(tmp_path / "hf")},
        )
        ours = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
        # one message per machine
        assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]
        assert all(w in ours[0] for w in wanted), ours
        assert elastic_root_cause(proc.stderr) == ours[0]
        # stopped before the group or the model
        assert "running FSDP over gloo" not in proc.stdout and not out.exists()


@pytest.mark.parametrize("value", ["fsdp_version: 2", [1, 2], 3, True])
@pytest.mark.parametrize("key", ["fsdp_config", "parallelism_config"])
def test_a_section_that_is_not_a_mapping_is_the_one_error(key, value):
    """Not a crash, and no errors that only follow from it (fsdp_config: [1, 2] also said "fsdp_version: missing")."""
    shipped = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    problems = check_settings({**shipped, key: value}, "x.yaml")
    assert [(p.key, "must be a mapping" in str(p)) for p in problems] == [(key, True)], problems


def test_a_missing_num_processes_is_named_missing():
    """Not "num_processes: -1 is not a positive integer", a value nobody wrote."""
    shipped = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    problems = errors(check_settings({k: v for k, v in shipped.items() if k != "num_processes"}, "x.yaml"))
    assert [str(p) for p in problems if p.key == "num_processes"] and "num_processes: missing" in str(problems[0]), (
        problems
    )
    assert "is not a positive integer" in str(errors(check_settings({**shipped, "num_processes": True}, "x.yaml"))[0])


def test_the_optimizers_refused_under_fsdp2_are_those_that_cannot_step_a_dtensor():
    """Every optimizer the Trainer can build here (--optim; the others need packages or devices this machine lacks)
    steps a DTensor parameter, as FSDP2 shards them, or is refused by the config check: measured, not listed by
    hand. `--optim adafactor` under FSDP2 failed at the first step, after the model had loaded. In this process, on
    a gloo process group of one (an in-memory store), built after the Trainer's optimizer lookups."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import Trainer, TrainingArguments
    from transformers.training_args import OptimizerNames

    built = {}
    for name in OptimizerNames:
        try:
            args = TrainingArguments(output_dir="unused", optim=name.value, report_to=[], use_cpu=True)
            built[name.value] = Trainer.get_optimizer_cls_and_kwargs(args)
        except (ImportError, ValueError):
            # a package or device this machine lacks
            continue
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    verdicts = {}
    try:
        mesh = init_device_mesh("cpu", (1,))
        for name, (cls, kwargs) in built.items():
            params = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))]
            params[0].grad = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cls(params, **kwargs).step()
                verdicts[name] = "steps"
            except Exception:
                verdicts[name] = "fails"
    finally:
        dist.destroy_process_group()
    # the probe itself works
    assert verdicts.get("adamw_torch") == "steps"
    from fsdp_recipes.config.recipe_checks import FSDP2_UNSTEPPABLE_OPTIMIZERS

    failing = {name for name, verdict in verdicts.items() if verdict == "fails"}
    assert failing == set(FSDP2_UNSTEPPABLE_OPTIMIZERS) & set(verdicts), verdicts
    # and the check says so, only for those
    for name in verdicts:
        problems = [
            p
            for p in check_config(REPO / "accelerate_configs" / "zero3.yaml", recipe={"optim": name})
            if p.key == "optim"
        ]
        assert bool(problems) == (name in failing), (name, [str(p) for p in problems])
        assert not [
            p
            for p in check_config(REPO / "accelerate_configs" / "fsdp1" / "zero3.yaml", recipe={"optim": name})
            if p.key == "optim"
        ]


@pytest.mark.parametrize(
    "recipe", sorted((REPO / "recipes").glob("*/*.yaml")), ids=lambda p: p.relative_to(REPO / "recipes").as_posix()
)
def test_a_recipe_given_as_the_config_is_one_error_saying_so(recipe):
    """A recipe given where the accelerate config goes is one error saying so, not an "unknown key" error per recipe
    key with accelerate's whole key list each time, and "distributed_type None"."""
    problems = check_config(recipe)
    assert (
        len(problems) == 1 and "it is not an accelerate config" in problems[0].message and "--recipe" in problems[0].fix
    ), problems


# fsdp_transformer_layer_cls_to_wrap as a careless or hostile config gives it: accelerate str()s the value, splits it
# at each ',' and looks for a module class of exactly each name
NOT_CLASS_NAMES = [
    '__import__("os").system("touch /tmp/owned")',
    "LlamaDecoderLayer; import os",
    "lambda m: True",
    "LlamaDecoderLayer, LlamaMLP",
    " LlamaDecoderLayer",
    "LlamaDecoderLayer,",
    ",",
    "",
    "transformers.LlamaDecoderLayer",
    "Llama\nDecoderLayer",
    "x" * 300 + "()",
    ["LlamaDecoderLayer"],
    {"cls": "LlamaDecoderLayer"},
    7,
    True,
]


@pytest.mark.parametrize("value", NOT_CLASS_NAMES, ids=[repr(v)[:40] for v in NOT_CLASS_NAMES])
@pytest.mark.parametrize("base", [FSDP2, FSDP1], ids=["fsdp2", "fsdp1"])
def test_a_wrap_class_that_is_no_class_name_is_one_error_without_a_model(base, value):
    problems = check_settings(variant(base, fsdp_transformer_layer_cls_to_wrap=value), "x.yaml")
    wrap = [p for p in errors(problems) if p.key == "fsdp_config.fsdp_transformer_layer_cls_to_wrap"]
    assert len(wrap) == 1, [str(p) for p in problems]
    assert "is not a class name" in str(wrap[0]) and "\n" not in str(wrap[0]) and len(str(wrap[0])) < 500
    # as accelerate reads them: taken
    for names in ("LlamaDecoderLayer", "LlamaDecoderLayer,LlamaMLP"):
        taken = check_settings(variant(base, fsdp_transformer_layer_cls_to_wrap=names), "x.yaml")
        assert not [p for p in errors(taken) if "is not a class name" in str(p)], [str(p) for p in taken]


ACCELERATE_AS_RECIPE = "is an accelerate config"


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_an_accelerate_config_given_as_the_recipe_is_said_so_by_both(config):
    """check_config.py --recipe <an accelerate config>, and train_fsdp.py <an accelerate config>: one error, in the
    same words, naming accelerate launch --config_file; not "ok", not an unknown-key list."""
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.errors import RecipeError

    problems = check_config(REPO / "accelerate_configs" / "zero3.yaml", REPO / config)
    assert len(problems) == 1 and problems[0].file == str(REPO / config), [str(p) for p in problems]
    said = problems[0]
    assert ACCELERATE_AS_RECIPE in said.message and f"accelerate launch --config_file {REPO / config}" in said.fix
    with pytest.raises(RecipeError) as err:
        parse_args([str(REPO / config), "--output_dir", "unused"])
    assert str(err.value) == f"{REPO / config} {said.message}: {said.fix}"


# a shipped recipe's key misspelt, or an accelerate key put into a recipe: named by the check as train_fsdp.py names it
TYPOS = {
    "learning_rate": "learnig_rate",
    "per_device_train_batch_size": "per_device_batch_size",
    "block_size": "blocksize",
    "max_steps": "max_step",
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("change", [*TYPOS, "mixed_precision added"])
def test_a_recipe_key_train_fsdp_refuses_is_an_error_of_the_check(tmp_path, recipe, change):
    text = yaml.safe_load((REPO / recipe).read_text())
    if change == "mixed_precision added":
        # accelerate's key, in a recipe that is otherwise one
        text["mixed_precision"] = "bf16"
        wrong = "mixed_precision"
    elif change in text:
        text[TYPOS[change]] = text.pop(change)
        wrong = TYPOS[change]
    else:
        pytest.skip(f"{recipe} sets no {change}")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(text))
    problems = errors(check_config(REPO / "accelerate_configs" / "zero3.yaml", path, model=TINY))
    assert len(problems) == 1 and problems[0].file == str(path), [str(p) for p in problems]
    assert f"unknown key(s): {wrong}" in problems[0].message and ACCELERATE_AS_RECIPE not in problems[0].message


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
@pytest.mark.parametrize("empty", ["config", "recipe"])
def test_an_empty_config_or_recipe_is_one_line_naming_the_file(tmp_path, empty, text):
    """accelerate fails on an empty config with an AttributeError, and train_fsdp.py refuses an empty recipe (no
    model): the check says so for the file, once, instead of "distributed_type: is None" or "ok"."""
    path = tmp_path / f"{empty}.yaml"
    path.write_text(text)
    config = path if empty == "config" else REPO / "accelerate_configs" / "zero3.yaml"
    recipe = path if empty == "recipe" else REPO / "recipes" / "tiny-llama" / "pretrain.yaml"
    [problem] = errors(check_config(config, recipe_path=recipe))
    assert problem.file == str(path) and problem.message.startswith("is empty"), str(problem)


@pytest.mark.parametrize("case", ["unreadable config", "unknown recipe key", "recipe given as the config", "empty"])
def test_a_problem_of_a_whole_file_reads_file_then_message(tmp_path, case):
    """A problem no key holds is printed as "error: FILE: what is wrong; fix: ...", with no empty key field."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.01\nmixed_precision: bf16\n")
    config, given = REPO / "accelerate_configs" / "zero3.yaml", {"recipe_path": recipe}
    if case == "unreadable config":
        config, given = tmp_path, {}
    elif case == "recipe given as the config":
        config, given = REPO / "recipes" / "tiny-llama" / "pretrain.yaml", {}
    elif case == "empty":
        (config := tmp_path / "empty.yaml").write_text("")
    [problem] = errors(check_config(config, **given))[:1]
    line = str(problem)
    assert line.startswith("error: ") and ": : " not in line and ": -: " not in line, line
    assert line.split(": ", 2)[2][0].isalpha(), line


COMPILE_ROUTES = {
    "config dynamo_config": ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, {}),
    "config regional": (
        {"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}},
        {},
    ),
    "torch_compile": ({}, {"torch_compile": True}),
    "torch_compile_backend": ({}, {"torch_compile_backend": "inductor"}),
    "torch_compile_mode": ({}, {"torch_compile_mode": "max-autotune"}),
}


@pytest.mark.parametrize("route", sorted(COMPILE_ROUTES))
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_compilation_is_refused_under_fsdp1_alone(tmp_path, config, route):
    """accelerate's compilation fails on the FSDP1 wrapper (a RecursionError on every rank, or a model no FSDP check
    knows): one line naming the setting and FSDP2, where FSDP2 and DDP compile."""
    extra, recipe = COMPILE_ROUTES[route]
    raw = {**yaml.safe_load((REPO / config).read_text()), **extra}
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    (recipe_path := tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"learning_rate": 1e-3, **recipe}))
    found = [p for p in errors(check_config(path, recipe_path=recipe_path)) if "compiles the model" in p.message]
    if "fsdp1/" in config:
        [problem] = found
        assert "accelerate_configs/zero3.yaml" in problem.fix
        assert problem.file == str(recipe_path if recipe else path), problem
    else:
        assert found == []
    # and torch_compile: false compiles nothing
    if route == "torch_compile":
        (recipe_path := tmp_path / "off.yaml").write_text(yaml.safe_dump({"torch_compile": False}))
        (path := tmp_path / "plain.yaml").write_text((REPO / config).read_text())
        assert not [p for p in errors(check_config(path, recipe_path=recipe_path)) if "compiles" in p.message]


@pytest.mark.parametrize(
    "flags", [("--dynamo_backend", "inductor"), ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")]
)
def test_compilation_by_launch_flags_is_named_by_its_flag_under_fsdp1(flags):
    from fsdp_recipes.config.launcher import check, from_launch_args

    for config, refused in (("accelerate_configs/fsdp1/zero3.yaml", True), ("accelerate_configs/zero3.yaml", False)):
        settings = from_launch_args(["--config_file", config, *flags, "train_fsdp.py"], REPO)
        found = [p for p in errors(check(settings, {}, None)) if "compiles the model" in p.message]
        assert len(found) == refused and (not refused or "--dynamo_backend" in str(found[0])), found


@pytest.mark.parametrize(
    "prefix",
    [
        ("/usr/bin/accelerate", "launch"),
        ("accelerate", "launch"),
        ("/usr/bin/python3", "-m", "accelerate.commands.accelerate_cli", "launch"),
        ("/usr/bin/python3", "-m", "accelerate.commands.launch"),
        ("/usr/local/bin/accelerate-launch",),
    ],
    ids=["accelerate", "bare", "cli-module", "launch-module", "accelerate-launch"],
)
def test_every_spelling_of_accelerate_launch_gives_its_arguments(prefix):
    """The run reads the launch's config from its launcher's command line: missed, auto batch sizes and the config
    checks fell back to a launch without accelerate (NO_SHARD). Tuples: test_suite_layout reads a list that names a
    launcher as a launch."""
    from fsdp_recipes.config.launcher import launch_arguments

    rest = ["--config_file", "accelerate_configs/zero3.yaml", "train_fsdp.py", "--max_steps", "2"]
    assert launch_arguments([*prefix, *rest]) == rest
    torchrun = ("torchrun", "--nproc_per_node", "2", "train_fsdp.py")
    assert launch_arguments([*torchrun]) is None
    assert launch_arguments(["python", "-m", "accelerate.commands.accelerate_cli", "env"]) is None


@pytest.mark.parametrize("key", ["dynamo_backend", "backend"])
def test_a_dynamo_config_without_accelerates_prefix_compiles_too(tmp_path, key):
    """accelerate adds the dynamo_ prefix to dynamo_config's keys itself: `backend: INDUCTOR` compiles as well."""
    raw = {**yaml.safe_load((REPO / "accelerate_configs" / "fsdp1" / "zero3.yaml").read_text())}
    raw["dynamo_config"] = {key: "INDUCTOR"}
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    [problem] = [p for p in errors(check_config(path)) if "compiles the model" in p.message]
    assert problem.key == f"dynamo_config.{key}"


# launches that set accelerate's variables themselves (torchrun, srun), and TrainingArguments' --fsdp
ENV_ROUTES = {
    "ACCELERATE_DYNAMO_BACKEND": ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, ()),
    "torch_compile": ({}, ("--torch_compile", "true")),
    # an empty one turns compilation on too
    "torch_compile_backend": ({}, ("--torch_compile_backend", "")),
    "torch_compile_mode": ({}, ("--torch_compile_mode", "default")),
}


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize("route", sorted(ENV_ROUTES))
def test_compilation_under_fsdp1_is_refused_by_accelerates_variables(tmp_path, monkeypatch, route, version):
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.errors import RecipeError

    env, flags = ENV_ROUTES[route]
    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": version, "WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(name, value)
    argv = ["--output_dir", str(tmp_path / "run"), *flags]
    if version == "1":
        with pytest.raises(RecipeError, match=f"{route}:? compiles the model, which FSDP1 cannot run here"):
            parse_args(argv)
    else:
        parse_args(argv)


# fsdp_config's version keys as a torchrun user may write them
TRAINER_VERSIONS = {
    "none": {},
    "1": {"version": 1},
    "2": {"version": 2},
    "the string 1": {"version": "1"},
    "2.0": {"version": 2.0},
    "prefixed 1": {"fsdp_version": 1},
    "1, prefixed 2": {"version": 1, "fsdp_version": 2},
    "2, prefixed 1": {"version": 2, "fsdp_version": 1},
}


@pytest.mark.parametrize("case", sorted(TRAINER_VERSIONS))
def test_compilation_on_the_torchrun_route_is_refused_exactly_under_trainingarguments_fsdp1(
    tmp_path, monkeypatch, case
):
    """The FSDP version is the one TrainingArguments itself takes from the fsdp_config (its fsdp_plugin_args, the
    oracle): compilation is refused under version 1 alone."""
    from transformers import TrainingArguments

    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.errors import RecipeError

    config = json.loads((REPO / "accelerate_configs" / "torchrun" / "zero3.json").read_text())
    config.pop("version")
    config.update(TRAINER_VERSIONS[case])
    (path := tmp_path / "fsdp.json").write_text(json.dumps(config))
    # TrainingArguments with fsdp sets accelerate's FSDP_* variables: not for later
    with mock.patch.dict(os.environ):
        oracle = TrainingArguments(output_dir=str(tmp_path / "oracle"), fsdp=True, fsdp_config=str(path), use_cpu=True)
    # torchrun's 2 processes (after the oracle: one process, no group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [
        "--fsdp",
        "true",
        "--fsdp_config",
        str(path),
        "--torch_compile",
        "true",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    if oracle.fsdp_plugin_args["fsdp_version"] == 2:
        parse_args(argv)
    else:
        with pytest.raises(RecipeError, match="^torch_compile compiles the model, which FSDP1 cannot run here"):
            parse_args(argv)


@pytest.mark.parametrize(
    "setting",
    [{"torch_compile": True}, {"torch_compile_backend": ""}, {"torch_compile_mode": "default"}, {"zero1": True}],
    ids=lambda s: next(iter(s)),
)
def test_a_launch_names_a_problem_of_the_runs_own_settings_as_its_recipe_or_flags(setting):
    """In a launch, the run's settings come from its recipe or its flags, not a file named recipe."""
    from fsdp_recipes.config.launcher import RUN_ARGUMENTS, check, from_launch_args

    settings = from_launch_args(["--config_file", "accelerate_configs/fsdp1/zero3.yaml", "train_fsdp.py"], REPO)
    [problem] = [p for p in errors(check(settings, setting, None)) if p.key == next(iter(setting))]
    assert problem.file == RUN_ARGUMENTS == "train_fsdp.py's recipe or flags", problem
