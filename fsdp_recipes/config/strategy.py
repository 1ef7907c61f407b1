"""Which strategy an accelerate config trains with: the one mapping from a config to FULL_SHARD, SHARD_GRAD_OP,
NO_SHARD, HYBRID_SHARD(_ZERO2), DDP or ZERO1, offload or not, and the FSDP version.

FSDP1 names its strategy (``fsdp_sharding_strategy``); FSDP2 has none and says it with
``fsdp_reshard_after_forward`` (true: FULL_SHARD, false: SHARD_GRAD_OP) and, for HYBRID_SHARD, a device mesh
of more than one replica (``parallelism_config_dp_replicate_size`` > 1). A MULTI_GPU or MULTI_CPU config
without ``fsdp_config`` is DDP, and ZERO1 with the recipe's ``zero1``.

Used by the training report (fsdp_recipes.train.sharding), the memory estimator (fsdp_recipes.config.memory,
tools/estimate_memory.py), bench/estimate_calibration.py and the tests. Standard library and the bounded YAML
reader only: no torch, transformers or accelerate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from fsdp_recipes.bounded import load_yaml
from fsdp_recipes.tiny import REPO_ROOT

CONFIG_DIR = REPO_ROOT / "accelerate_configs"
# accelerate's distributed types for DistributedDataParallel
DDP_TYPES = ("MULTI_GPU", "MULTI_CPU")
# a DDP config's label with the recipe flag that makes it ZeRO-1
ZERO1_LAUNCH = " --zero1 true"


@dataclass(frozen=True)
class Strategy:
    # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 (FSDP1: as its file says), DDP, ZERO1
    name: str
    # parameters, gradients and the optimizer step in CPU RAM (fsdp_offload_params)
    offload: bool = False
    # None: DDP or ZERO1, no FSDP
    fsdp_version: int | None = None

    @property
    def memory_strategy(self) -> str:
        """The name the memory formulas know (fsdp_recipes.config.memory.STRATEGIES): they count HYBRID_SHARD_ZERO2
        as HYBRID_SHARD."""
        return "HYBRID_SHARD" if self.name == "HYBRID_SHARD_ZERO2" else self.name

    def memory_strategy_on(self, world: int, per_node: int | None = None) -> str:
        """memory_strategy as it runs on ``world`` processes (``per_node`` of them on each node): FSDP1 in a shard
        group of one process is NO_SHARD whatever the config names (torch switches, warning "FSDP is switching to use
        NO_SHARD ..."): on one process, and for HYBRID_SHARD with one process per node. On one H200 FSDP1's FULL_SHARD,
        SHARD_GRAD_OP, HYBRID_SHARD and NO_SHARD peaked at the same 18.00 GiB (bench/results/h200/gpu-check-1, -4,
        -5). FSDP2 keeps its strategy: its SHARD_GRAD_OP still holds the bf16 parameters from forward to backward
        on one GPU (1.7 GiB over FULL_SHARD's peak there)."""
        alone = world == 1 or (self.name in FSDP1_HYBRID and per_node == 1)
        return "NO_SHARD" if self.fsdp_version == 1 and alone else self.memory_strategy


# as accelerate and torch name them
FSDP1_HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2")


def fsdp1_hybrid_problem(strategy: str | None, devices_per_process: int, local_world: int, world: int) -> str | None:
    """What is wrong, if anything, with FSDP1 HYBRID_SHARD here: torch groups ranks into "nodes" of as many ranks as
    each process sees devices (torch.cuda.device_count()), not by the node's processes. Seeing one device (one GPU
    per task under SLURM, or a CPU), every process is a node of one: torch switches it to NO_SHARD in that group
    of one and never reduces gradients across processes, so the ranks train apart without a word (measured on 2
    CPU processes: the losses parted from the third step and the gradient norm halved)."""
    strategy = None if strategy is None else str(getattr(strategy, "name", strategy)).strip().upper()
    if strategy not in FSDP1_HYBRID or int(world) <= 1:
        return None
    devices_per_process, local_world = int(devices_per_process), int(local_world)
    if devices_per_process == 1:
        return (
            f"FSDP1 {strategy} with one device visible to each process would train every process alone: torch "
            "makes each process a node of one (NO_SHARD in a group of one) and never reduces gradients across "
            "processes; make all of a node's GPUs visible to each of its processes, or use "
            "accelerate_configs/fsdp1/zero3.yaml or accelerate_configs/zero3.yaml"
        )
    if devices_per_process != local_world:
        return (
            f"FSDP1 {strategy} groups ranks by the {devices_per_process} devices each process sees, but this node "
            f"runs {local_world} processes: its shard groups would not be the nodes; launch one process per GPU "
            "with all of the node's GPUs visible, or use accelerate_configs/fsdp1/zero3.yaml"
        )
    return None


def as_flag(value) -> bool:
    """A config's true/false as accelerate reads it (accelerate.utils.str_to_bool on strings: "false" is false)."""
    if isinstance(value, str):
        return value.strip().lower() in ("y", "yes", "t", "true", "on", "1")
    return bool(value)


def fsdp_strategy_name(
    fsdp_version: int, reshard_after_forward: bool = True, sharding_strategy=None, dp_replicate_size: int = 1
):
    """The strategy FSDP runs: FSDP2's from its resharding and mesh, FSDP1's as named (None where unnamed)."""
    if fsdp_version == 2:
        if dp_replicate_size > 1:
            return "HYBRID_SHARD" if reshard_after_forward else "HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
    return sharding_strategy


def strategy_of(config: dict, zero1: bool = False) -> Strategy:
    """The strategy of an accelerate config mapping (as its YAML holds it), with accelerate's defaults for unset
    keys (fsdp_version 1, FULL_SHARD, reshard after forward, one replica, no offload). ``zero1``: the recipe's
    zero1, which makes a DDP config ZERO1. A value of the wrong type raises ValueError, TypeError or OverflowError
    (int() of a word, a list, .inf); tools/check_config.py names the key."""
    fsdp, pc = config.get("fsdp_config") or {}, config.get("parallelism_config") or {}
    if not (isinstance(fsdp, dict) and isinstance(pc, dict)):
        raise ValueError("fsdp_config or parallelism_config has the wrong type")
    if config.get("distributed_type") in DDP_TYPES and not fsdp:
        return Strategy("ZERO1" if zero1 else "DDP")
    version = int(fsdp.get("fsdp_version", 1))
    if version == 2:
        name = fsdp_strategy_name(
            2,
            reshard_after_forward=as_flag(fsdp.get("fsdp_reshard_after_forward", True)),
            dp_replicate_size=int(pc.get("parallelism_config_dp_replicate_size", 1)),
        )
    else:
        name = fsdp_strategy_name(version, sharding_strategy=str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")))
    return Strategy(name, as_flag(fsdp.get("fsdp_offload_params", False)), version)


@functools.cache
def shipped_configs(config_dir: Path = CONFIG_DIR) -> dict[str, Strategy]:
    """Every launch the repository ships, by its label (the YAML's path under accelerate_configs/, and for a DDP
    config also '<path> --zero1 true'), and its strategy, read from the files."""
    table = {}
    for path in sorted(Path(config_dir).rglob("*.yaml")):
        label, config = path.relative_to(config_dir).as_posix(), load_yaml(path, "accelerate config")
        table[label] = strategy_of(config)
        if table[label].name == "DDP":
            table[label + ZERO1_LAUNCH] = strategy_of(config, zero1=True)
    return table
