"""fsdp_recipes.config.strategy: every shipped accelerate config maps to the strategy its file says, the memory
estimator lists every shipped strategy, and the training report names strategies the same way."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO

from fsdp_recipes.config import memory
from fsdp_recipes.config.strategy import Strategy, shipped_configs, strategy_of

CONFIG_DIR = REPO / "accelerate_configs"
# walked here with os.walk, not with the module's rglob: a config in any subfolder counts
SHIPPED = sorted(
    Path(root, name).relative_to(CONFIG_DIR).as_posix()
    for root, _, files in os.walk(CONFIG_DIR)
    for name in files
    if name.endswith((".yaml", ".yml"))
)
NAMES = r"\b(FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD_ZERO2|HYBRID_SHARD)\b"


def read(label: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / label).read_text())


def expected(label: str) -> Strategy:
    """The strategy from the file's keys, read here without the module: a DDP type without fsdp_config is DDP; FSDP1
    names its strategy; FSDP2 says it with reshard_after_forward and the number of replicas."""
    cfg = read(label)
    fsdp = cfg.get("fsdp_config")
    if not fsdp:
        assert cfg["distributed_type"] in ("MULTI_GPU", "MULTI_CPU"), label
        return Strategy("DDP", False, None)
    assert cfg["distributed_type"] == "FSDP", label
    version = fsdp["fsdp_version"]
    if version == 1:
        name = fsdp["fsdp_sharding_strategy"]
    else:
        replicas = (cfg.get("parallelism_config") or {}).get("parallelism_config_dp_replicate_size", 1)
        name = {
            (True, False): "FULL_SHARD",
            (False, False): "SHARD_GRAD_OP",
            (True, True): "HYBRID_SHARD",
            (False, True): "HYBRID_SHARD_ZERO2",
        }[(fsdp.get("fsdp_reshard_after_forward", True) is True, replicas > 1)]
    return Strategy(name, fsdp.get("fsdp_offload_params", False) is True, version)


def title(label: str) -> str:
    """The header's opening sentence, after '<file>:' and before 'This is an accelerate ... config'."""
    lines = [
        line.lstrip("# ").rstrip() for line in (CONFIG_DIR / label).read_text().splitlines()[1:] if line.startswith("#")
    ]
    text = " ".join(lines).split("This is an accelerate")[0]
    return text.split(":", 1)[1]


def test_the_walk_finds_every_shipped_config():
    assert len(SHIPPED) == 10 and "ddp.yaml" in SHIPPED and "fsdp1/no_shard.yaml" in SHIPPED
    assert sorted(label for label in shipped_configs() if not label.endswith(" --zero1 true")) == SHIPPED


@pytest.mark.parametrize("label", SHIPPED)
def test_shipped_config_maps_to_the_strategy_its_file_says(label):
    want = expected(label)
    assert strategy_of(read(label)) == want
    assert shipped_configs()[label] == want
    # and the header says the same in words
    head = title(label)
    if want.fsdp_version is None:
        assert "DistributedDataParallel" in head and "--zero1 true" in head, head
        assert strategy_of(read(label), zero1=True) == shipped_configs()[label + " --zero1 true"] == Strategy("ZERO1")
    else:
        assert f"FSDP{want.fsdp_version}" in head, head
        assert re.search(NAMES, head).group(1) == want.name, head
    assert ("offload" in head.lower()) == want.offload, head


def test_unset_keys_take_accelerates_defaults_and_zero1_applies_only_to_ddp():
    assert strategy_of({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": True}}) == Strategy(
        "FULL_SHARD", True, 1
    )
    fsdp2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False}}
    assert strategy_of(fsdp2) == Strategy("SHARD_GRAD_OP", False, 2)
    hsdp = strategy_of({**fsdp2, "parallelism_config": {"parallelism_config_dp_replicate_size": 2}})
    assert hsdp == Strategy("HYBRID_SHARD_ZERO2", False, 2) and hsdp.memory_strategy == "HYBRID_SHARD"
    assert strategy_of(fsdp2, zero1=True).name == "SHARD_GRAD_OP"
    assert strategy_of({"distributed_type": "MULTI_CPU"}, zero1=True) == Strategy("ZERO1")
    for bad in ({"fsdp_config": [1]}, {"fsdp_config": {"fsdp_version": "two"}}):
        with pytest.raises(ValueError):
            strategy_of(bad)


def test_memory_table_covers_every_shipped_config():
    table = memory.shipped_table()
    rows = {(strategy, offload): label for label, strategy, offload in table}
    for label in SHIPPED:
        want = expected(label)
        name = {"HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}.get(want.name, want.name)
        assert (name, want.offload) in rows, label
    assert rows[("ZERO1", False)] == "ddp.yaml --zero1 true"
    for label, strategy, offload in table:
        assert strategy in memory.STRATEGIES
        want = expected(label.split()[0])
        assert (want.memory_strategy if "--zero1" not in label else "ZERO1", want.offload) == (strategy, offload), label
    assert [r[1] for r in table] == sorted((r[1] for r in table), key=memory.COMMUNICATION_ORDER.index)


@pytest.mark.parametrize("label", [c for c in SHIPPED if read(c).get("fsdp_config")])
def test_training_report_names_the_strategy_as_the_file_does(label):
    """sharding._strategy_name reads accelerate's plugin, not the file: fed what accelerate makes of the file, it
    gives the file's strategy."""
    from torch.distributed.fsdp import ShardingStrategy

    from fsdp_recipes.train.sharding import _strategy_name

    cfg, want = read(label), expected(label)
    fsdp = cfg["fsdp_config"]
    plugin = SimpleNamespace(
        fsdp_version=fsdp["fsdp_version"],
        reshard_after_forward=fsdp.get("fsdp_reshard_after_forward", True),
        sharding_strategy=ShardingStrategy[fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")],
    )
    mesh = SimpleNamespace(
        dp_replicate_size=(cfg.get("parallelism_config") or {}).get("parallelism_config_dp_replicate_size", 1)
    )
    assert _strategy_name(plugin, mesh) == want.name


@pytest.mark.parametrize("value", [None, "true", "TRUE", "True", "false", "1", "yes", ""])
def test_accelerate_use_fsdp_means_the_same_everywhere(value, monkeypatch):
    """cpu_fsdp.fsdp_requested reads ACCELERATE_USE_FSDP; the launcher's settings and the report's expected version
    follow it."""
    from fsdp_recipes.compat import cpu_fsdp
    from fsdp_recipes.config import launcher
    from fsdp_recipes.train.sharding import expected_fsdp_version

    env = {"WORLD_SIZE": "2", "FSDP_VERSION": "2"} | ({} if value is None else {"ACCELERATE_USE_FSDP": value})
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_DYNAMO_BACKEND"):
        monkeypatch.delenv(key, raising=False)
    for key, setting in env.items():
        monkeypatch.setenv(key, setting)
    asked = value is not None and value.lower() == "true"
    assert cpu_fsdp.fsdp_requested() == cpu_fsdp.fsdp_requested(env) == asked
    assert (launcher.from_environment(env) is not None) == asked
    assert expected_fsdp_version() == (2 if asked else None)


@pytest.mark.parametrize(
    "text, strategy, offload",
    [
        ("false", "SHARD_GRAD_OP", False),
        ("False", "SHARD_GRAD_OP", False),
        ("no", "SHARD_GRAD_OP", False),
        ("true", "FULL_SHARD", True),
    ],
)
def test_quoted_booleans_read_as_accelerate_reads_them(text, strategy, offload):
    """accelerate reads a quoted "false" as false (str_to_bool); bool("false") would be true."""
    from accelerate.utils import str_to_bool

    from fsdp_recipes.config.strategy import strategy_of

    # what accelerate itself makes of the text
    assert bool(str_to_bool(text)) is offload
    config = {
        "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": text, "fsdp_offload_params": text},
    }
    assert strategy_of(config).name == strategy and strategy_of(config).offload is offload


def test_fsdp1_on_one_process_is_no_shard_and_nothing_else_changes_with_the_world():
    """torch's FSDP1 switches any sharding strategy to NO_SHARD on a world of one; FSDP2, DDP and ZeRO-1 do not."""
    from fsdp_recipes.config.strategy import shipped_configs

    for label, strategy in shipped_configs().items():
        for world in (2, 3, 8, 64):
            assert strategy.memory_strategy_on(world) == strategy.memory_strategy, (label, world)
        alone = strategy.memory_strategy_on(1)
        assert alone == ("NO_SHARD" if strategy.fsdp_version == 1 else strategy.memory_strategy), label


def test_fsdp1_hybrid_is_refused_where_torch_would_train_processes_apart():
    """torch groups FSDP1 HYBRID_SHARD ranks by the devices each process sees: every combination of strategy,
    devices per process, processes per node and world; refused exactly when a process would be a node of one
    (no gradient crosses processes) or the groups are not the nodes."""
    from fsdp_recipes.config.strategy import FSDP1_HYBRID, fsdp1_hybrid_problem

    for strategy in (*FSDP1_HYBRID, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", None):
        for devices in (1, 2, 4, 8):
            for local in (1, 2, 4, 8):
                for nodes in (1, 2, 3):
                    world = local * nodes
                    problem = fsdp1_hybrid_problem(strategy, devices, local, world)
                    wrong = (
                        strategy in FSDP1_HYBRID
                        and world > 1
                        and devices != local
                        or (strategy in FSDP1_HYBRID and world > 1 and devices == 1)
                    )
                    assert (problem is not None) == wrong, (strategy, devices, local, world, problem)
                    if problem:
                        assert "\n" not in problem and "accelerate_configs/" in problem and strategy in problem
    assert "alone" in fsdp1_hybrid_problem("HYBRID_SHARD", 1, 1, 2) and "alone" in fsdp1_hybrid_problem(
        "HYBRID_SHARD", 1, 8, 16
    )


def test_the_fsdp1_strategy_is_read_as_accelerate_and_transformers_pass_it():
    from types import SimpleNamespace

    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    from fsdp_recipes.train.preflight import fsdp1_strategy

    plain = SimpleNamespace(fsdp_plugin_args=None)
    fsdp = {"ACCELERATE_USE_FSDP": "true"}
    # accelerate's names and 1-based numbers
    for number, name in enumerate(FSDP_SHARDING_STRATEGY, start=1):
        assert fsdp1_strategy(plain, {**fsdp, "FSDP_SHARDING_STRATEGY": name}) == name
        assert fsdp1_strategy(plain, {**fsdp, "FSDP_SHARDING_STRATEGY": str(number)}) == name
        assert fsdp1_strategy(plain, {**fsdp, "FSDP_SHARDING_STRATEGY": name.lower(), "FSDP_VERSION": "1"}) == name
        assert fsdp1_strategy(plain, {**fsdp, "FSDP_SHARDING_STRATEGY": name, "FSDP_VERSION": "2"}) is None
        # not an FSDP launch
        assert fsdp1_strategy(plain, {"FSDP_SHARDING_STRATEGY": name}) is None
    # accelerate's default
    assert fsdp1_strategy(plain, fsdp) == "FULL_SHARD"
    # the torchrun route: accelerate's FSDP1 plugin runs FSDP_SHARDING_STRATEGY (default FULL_SHARD) and never the
    # --fsdp option transformers hands it as reshard_after_forward: read so, and the ignored option refused
    from transformers import TrainingArguments

    from fsdp_recipes.train.preflight import fsdp1_ignored_option

    for option in ("hybrid_shard", "hybrid_shard_zero2", "full_shard", "shard_grad_op"):
        args = TrainingArguments(
            output_dir="unused",
            fsdp=f"{option} auto_wrap",
            report_to="none",
            fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )
        runs = fsdp1_strategy(args, {})
        assert runs == "FULL_SHARD"
        assert (fsdp1_ignored_option(f"{option} auto_wrap", runs) is None) == (option == "full_shard")
        assert (fsdp1_ignored_option([option, "auto_wrap"], runs) is None) == (option == "full_shard")
        for env_value in (option.upper(), str(FSDP_SHARDING_STRATEGY.index(option.upper()) + 1)):
            runs = fsdp1_strategy(args, {"FSDP_SHARDING_STRATEGY": env_value})
            assert runs == option.upper() and fsdp1_ignored_option(f"{option} auto_wrap", runs) is None
            # --fsdp true names none
            assert fsdp1_ignored_option(True, runs) is None and fsdp1_ignored_option("true", runs) is None
    ignored = fsdp1_ignored_option("hybrid_shard auto_wrap", "FULL_SHARD")
    assert (
        ignored.startswith("--fsdp hybrid_shard would run as FULL_SHARD")
        and "FSDP_SHARDING_STRATEGY=HYBRID_SHARD" in ignored
    )
    # not FSDP1: not this rule's
    assert fsdp1_ignored_option("hybrid_shard auto_wrap", None) is None
    args = TrainingArguments(
        output_dir="unused",
        fsdp=True,
        report_to="none",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    assert fsdp1_strategy(args, {"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}) is None
    # a strategy in any form accelerate or torch gives it
    from torch.distributed.fsdp import ShardingStrategy

    for member in ShardingStrategy:
        plugin = SimpleNamespace(fsdp_plugin_args={"fsdp_version": 1, "sharding_strategy": member})
        assert fsdp1_strategy(plugin, {}) == member.name.lstrip("_")
        assert (
            fsdp1_strategy(SimpleNamespace(fsdp_plugin_args={"fsdp_version": 1, "sharding_strategy": member.value}), {})
            == FSDP_SHARDING_STRATEGY[member.value - 1]
        )


def test_the_report_names_the_fsdp1_strategy_torch_runs():
    """fsdp_report.json said FULL_SHARD for an FSDP1 run on one GPU, which torch runs as NO_SHARD (so the memory was
    NO_SHARD's: bench/results/h200/gpu-check-4); it now names what torch runs, read from the wrapper, and keeps the
    configured one beside it. A real FSDP1 wrapper in a gloo process group of one (an in-memory store)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from fsdp_recipes.train.sharding import fsdp1_runs_as

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs_as = {}
    try:
        for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            # torch's own note that one process runs as NO_SHARD
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                wrapped = FSDP(
                    torch.nn.Linear(4, 4), sharding_strategy=ShardingStrategy[name], device_id=torch.device("cpu")
                )
            runs_as[name] = fsdp1_runs_as(wrapped)
    finally:
        dist.destroy_process_group()
    assert runs_as == {"FULL_SHARD": "NO_SHARD", "SHARD_GRAD_OP": "NO_SHARD", "NO_SHARD": "NO_SHARD"}
    assert fsdp1_runs_as(torch.nn.Linear(2, 2)) is None
    # the estimator agrees
    assert Strategy("FULL_SHARD", fsdp_version=1).memory_strategy_on(1) == "NO_SHARD"
