"""Check an accelerate FSDP config (with its recipe and model) before it wastes a cluster.

Every problem at once, each with the file, the key, what is wrong and the fix. Errors make the check fail;
warnings are settings that work but cost, or that accelerate will silently ignore. The valid keys come from
accelerate itself (its config dataclass and its launch parser), so they follow the pinned version.

Size: over the limit since the tree was formatted; to be split by job.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_recipes.bounded import load_yaml
from fsdp_recipes.config.strategy import DDP_TYPES  # accelerate's distributed types for DistributedDataParallel
from fsdp_recipes.errors import UnreadableFile

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
STATE_DICT_TYPES = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]
WRAP_POLICIES = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
MIXED_PRECISION = ["no", "fp16", "bf16", "fp8"]
BOOL_KEYS = [
    "fsdp_offload_params",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
    "fsdp_forward_prefetch",
    "fsdp_activation_checkpointing",
    "fsdp_activation_checkpointing_offload",
]
FSDP1_ONLY = ["fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_use_orig_params"]
FSDP2_ONLY = ["fsdp_reshard_after_forward"]
# Trainer optimizers (--optim) whose step mixes plain tensors into FSDP2's DTensor parameters and fails at the first
# step ("got mixed torch.Tensor and DTensor"): measured with the installed transformers and torch by
# tests/unit/config/test_check_config.py (the names it can build on CPU; the others need packages or devices not here)
FSDP2_UNSTEPPABLE_OPTIMIZERS = {"adafactor": "transformers' Adafactor"}


def unsteppable_optimizer(optim) -> tuple[str, str] | None:
    """(problem, fix) for an --optim FSDP2 cannot step (a flag's string or an OptimizerNames member), else None."""
    name = str(getattr(optim, "value", optim) or "").strip().lower()
    if name not in FSDP2_UNSTEPPABLE_OPTIMIZERS:
        return None
    return (
        f"{name}: {FSDP2_UNSTEPPABLE_OPTIMIZERS[name]} cannot step FSDP2's sharded (DTensor) parameters: the run would fail "
        "at its first optimizer step, after loading the model",
        "use adamw_torch (or sgd, adagrad, rmsprop), or an FSDP1 config",
    )


# (why, fix) of the refusal of save_only_model, under every config (here, and in launcher.check_launch for every launch)
SAVE_ONLY_MODEL = (
    "is refused: its checkpoints hold the model weights without optimizer state, so they cannot resume a run "
    "(a stopped run could only start over); the final model is written to output_dir/model anyway",
    "drop save_only_model (to keep less on disk, lower save_total_limit)",
)
ZERO1_UNDER_FSDP = "is for DDP launches (accelerate_configs/ddp.yaml); under FSDP it would wrap a sharded optimizer in a second sharding"
LARGE_MODEL = 1_000_000_000  # parameters above which FULL_STATE_DICT gathering on rank 0 becomes a problem


@dataclass
class Problem:
    level: str  # "error" or "warning"
    file: str
    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level}: {self.file}: {self.key}: {self.message}; fix: {self.fix}"


def _known_keys() -> tuple[set[str], set[str], set[str]]:
    """(top-level, fsdp_config, parallelism_config) keys that accelerate 1.15 reads."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    dests = {a.dest for a in launch_command_parser()._actions}
    return (
        set(ClusterConfig.__dataclass_fields__),
        {d for d in dests if d.startswith("fsdp_")},
        {d for d in dests if d.startswith("parallelism_config_")},
    )


def _recipe_keys() -> set[str]:
    """The keys a training recipe sets (its argument dataclasses' and TrainingArguments' fields)."""
    import dataclasses

    from transformers import TrainingArguments

    from fsdp_recipes.config.arguments import DataArguments, ModelArguments, RunArguments

    return {
        f.name
        for cls in (ModelArguments, DataArguments, RunArguments, TrainingArguments)
        for f in dataclasses.fields(cls)
    }


def _suggest(key: str, valid, what: str = "keys") -> str:
    close = (
        difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
        or sorted(v for v in valid if v.startswith(key))[:1]
    )
    return f"did you mean {close[0]}?" if close else f"valid {what}: {', '.join(sorted(valid))}"


def _as_bool(value) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


class _Checker:
    def __init__(self, path: str):
        self.path, self.problems = path, []

    def error(self, key, message, fix, file=None):
        self.problems.append(Problem("error", file or self.path, key, message, fix))

    def warn(self, key, message, fix, file=None):
        self.problems.append(Problem("warning", file or self.path, key, message, fix))


def check_config(
    config_path: str | os.PathLike,
    recipe_path: str | os.PathLike | None = None,
    model: str | None = None,
    recipe: dict | None = None,
) -> list[Problem]:
    """All problems of an accelerate config, alone or with a recipe YAML (or its parsed dict) and a model.

    ``model``: a hub id, a local folder or a config.json; only its config is read (on the meta device).
    """
    c = _Checker(str(config_path))
    try:  # within bounds (fsdp_recipes.bounded): no folder, pipe, device, oversize or binary file, no YAML aliases
        raw = load_yaml(config_path, "accelerate config")
        if recipe is None and recipe_path is not None:
            recipe = load_yaml(recipe_path, "recipe")
    except UnreadableFile as err:
        c.error("-", err.reason, err.fix, file=err.path)
        return c.problems
    return check_settings(raw, str(config_path), recipe, str(recipe_path or "recipe"), model)


def check_settings(
    raw: dict,
    label: str,
    recipe: dict | None = None,
    recipe_file: str = "recipe",
    model: str | None = None,
    check_keys: bool = True,
) -> list[Problem]:
    """All problems of accelerate settings given as a config mapping; ``label`` names where they came from.
    ``check_keys=False`` skips the unknown-key rules (settings that accelerate itself named, not a file)."""
    c = _Checker(label)
    recipe = recipe or {}
    top, fsdp_keys, pc_keys = _known_keys()
    fsdp = raw.get("fsdp_config") or {}
    pc = raw.get("parallelism_config") or {}
    if not isinstance(fsdp, dict):
        c.error("fsdp_config", "must be a mapping", "indent the fsdp_* keys under fsdp_config:")
        fsdp = {}
    if not isinstance(pc, dict):
        c.error(
            "parallelism_config", "must be a mapping", "indent the parallelism_config_* keys under parallelism_config:"
        )
        pc = {}
    if c.problems:  # every other check reads these mappings: what it would say follows from this alone
        return c.problems
    if (
        check_keys and raw and not set(raw) & top and set(raw) & _recipe_keys()
    ):  # a recipe as the config: one line, not one per key
        c.error(
            "-",
            f"holds none of accelerate's config keys (it has {', '.join(sorted(raw)[:4])}{', ...' if len(raw) > 4 else ''}): "
            "it is not an accelerate config",
            "give an accelerate config first (accelerate_configs/zero3.yaml); a training recipe goes after --recipe",
        )
        return c.problems
    for key in raw if check_keys else ():
        if key not in top:
            c.error(key, "unknown key (accelerate refuses the file)", _suggest(key, top))
    for key in fsdp if check_keys else ():
        if key not in fsdp_keys:
            c.error(f"fsdp_config.{key}", "unknown key (accelerate would silently ignore it)", _suggest(key, fsdp_keys))
    for key in pc if check_keys else ():
        if key not in pc_keys:
            c.error(
                f"parallelism_config.{key}", "unknown key (accelerate would silently ignore it)", _suggest(key, pc_keys)
            )

    dist_type = raw.get("distributed_type")
    ddp = dist_type in DDP_TYPES and not fsdp  # accelerate_configs/ddp.yaml: DDP, and ZeRO-1 with the recipe's zero1
    if dist_type != "FSDP" and not ddp:
        if fsdp:
            c.error(
                "distributed_type",
                f"is {dist_type!r} but the file carries fsdp_config, which is then ignored",
                "set distributed_type: FSDP",
            )
        else:
            c.error(
                "distributed_type",
                f"is {dist_type!r}, not FSDP or DDP",
                "set distributed_type: FSDP and add fsdp_config (or MULTI_GPU for DDP, as accelerate_configs/ddp.yaml)",
            )
        return c.problems

    mp = raw.get("mixed_precision", "no")
    if mp not in MIXED_PRECISION:
        c.error(
            "mixed_precision", f"{mp!r} is not one of {', '.join(MIXED_PRECISION)}", "use bf16 on GPUs that support it"
        )
    elif mp == "fp16" and not ddp:
        c.warn(
            "mixed_precision",
            "fp16 with FSDP needs a sharded gradient scaler and overflows more easily than bf16",
            "use bf16 where the GPU supports it",
        )
    if ddp:
        version = strategy = sd_type = wrap = None
    else:
        version, strategy, sd_type, wrap = _check_fsdp_keys(c, fsdp)
        if _as_bool(recipe.get("zero1")):
            c.error(
                "zero1",
                ZERO1_UNDER_FSDP,
                "drop zero1 (FSDP shards the optimizer state already), or launch with accelerate_configs/ddp.yaml",
                file=recipe_file,
            )
    _check_processes(c, raw, fsdp, pc, version, strategy)
    _check_with_recipe(c, recipe, recipe_file, fsdp, version, sd_type, mp, ddp)

    # ----- with the model -----
    model = model or recipe.get("model_name_or_path") or recipe.get("config_name")
    if model and not ddp:
        _check_model(c, fsdp, wrap, sd_type, model, bool(_as_bool(recipe.get("trust_remote_code"))))
    return c.problems


def _check_fsdp_keys(c: _Checker, fsdp: dict) -> tuple:
    """The fsdp_config section alone; returns (version, sharding strategy, state-dict type, wrap policy)."""
    version = fsdp.get("fsdp_version")
    if version is None:
        c.error("fsdp_config.fsdp_version", "missing: accelerate then defaults to FSDP1", "set fsdp_version: 2 (or 1)")
        version = 1
    elif str(version) not in ("1", "2"):
        c.error("fsdp_config.fsdp_version", f"{version!r} is not 1 or 2", "set fsdp_version: 2 (or 1)")
        version = 1
    version = int(version)

    for key in BOOL_KEYS + (["fsdp_reshard_after_forward"] if version == 2 else []):
        if key in fsdp and _as_bool(fsdp[key]) is None:
            c.error(f"fsdp_config.{key}", f"{fsdp[key]!r} is not true or false", f"set {key}: true or false")

    strategy = fsdp.get("fsdp_sharding_strategy")
    if version == 2:
        for key in FSDP1_ONLY:
            if key in fsdp:
                fix = (
                    "use fsdp_reshard_after_forward: true (FULL_SHARD) or false (SHARD_GRAD_OP)"
                    if key == "fsdp_sharding_strategy"
                    else f"remove {key}"
                )
                c.error(f"fsdp_config.{key}", "is an FSDP1 setting; fsdp_version: 2 ignores it", fix)
    else:
        for key in FSDP2_ONLY:
            if key in fsdp:
                c.error(
                    f"fsdp_config.{key}",
                    "is an FSDP2 setting under fsdp_version: 1",
                    "use fsdp_sharding_strategy: FULL_SHARD or SHARD_GRAD_OP",
                )
        if strategy is not None:
            if isinstance(strategy, int) or (isinstance(strategy, str) and strategy.isdigit()):
                n = int(strategy)
                if 1 <= n <= len(STRATEGIES):
                    c.warn(
                        "fsdp_config.fsdp_sharding_strategy",
                        f"the legacy integer {n} means {STRATEGIES[n - 1]}",
                        f"write fsdp_sharding_strategy: {STRATEGIES[n - 1]}",
                    )
                    strategy = STRATEGIES[n - 1]
                else:
                    c.error(
                        "fsdp_config.fsdp_sharding_strategy",
                        f"integer {n} is not 1-5",
                        f"use one of {', '.join(STRATEGIES)}",
                    )
            elif strategy not in STRATEGIES:
                c.error(
                    "fsdp_config.fsdp_sharding_strategy",
                    f"{strategy!r} is not a strategy",
                    _suggest(str(strategy), STRATEGIES, "values"),
                )
        prefetch = fsdp.get("fsdp_backward_prefetch")
        if prefetch is not None and prefetch not in PREFETCH:
            c.error(
                "fsdp_config.fsdp_backward_prefetch",
                f"{prefetch!r} is not one of {', '.join(PREFETCH)}",
                "use BACKWARD_PRE",
            )
        elif prefetch == "BACKWARD_POST":
            c.warn(
                "fsdp_config.fsdp_backward_prefetch",
                "BACKWARD_POST overlaps less communication than BACKWARD_PRE",
                "use BACKWARD_PRE unless memory is tight",
            )
        if fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT") == "FULL_STATE_DICT" and _as_bool(
            fsdp.get("fsdp_use_orig_params", True)
        ):
            # train_fsdp.py refuses such a resume: measured, its first update differs from the run that never stopped
            c.warn(
                "fsdp_config.fsdp_state_dict_type",
                "FULL_STATE_DICT with fsdp_use_orig_params: true (FSDP1) writes checkpoints "
                "that do not resume exactly (torch 2.13)",
                "use SHARDED_STATE_DICT (every shipped config), or fsdp_use_orig_params: false",
            )

    sd_type = fsdp.get("fsdp_state_dict_type")
    if sd_type is not None and sd_type not in STATE_DICT_TYPES:
        c.error(
            "fsdp_config.fsdp_state_dict_type",
            f"{sd_type!r} is not a state-dict type",
            _suggest(str(sd_type), STATE_DICT_TYPES, "values"),
        )
    if version == 2 and sd_type == "LOCAL_STATE_DICT":
        c.error(
            "fsdp_config.fsdp_state_dict_type", "LOCAL_STATE_DICT does not exist in FSDP2", "use SHARDED_STATE_DICT"
        )
    wrap = fsdp.get("fsdp_auto_wrap_policy")
    if wrap is not None and wrap not in WRAP_POLICIES:
        c.error(
            "fsdp_config.fsdp_auto_wrap_policy",
            f"{wrap!r} is not a wrap policy",
            f"use one of {', '.join(WRAP_POLICIES)}",
        )
    if wrap != "TRANSFORMER_BASED_WRAP" and "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        c.warn(
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
            f"ignored: the wrap policy is {wrap}",
            "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP or remove the key",
        )
    if wrap != "SIZE_BASED_WRAP" and "fsdp_min_num_params" in fsdp:
        c.warn(
            "fsdp_config.fsdp_min_num_params",
            f"ignored: the wrap policy is {wrap}",
            "remove it, or set fsdp_auto_wrap_policy: SIZE_BASED_WRAP",
        )

    if _as_bool(fsdp.get("fsdp_cpu_ram_efficient_loading")) and not _as_bool(fsdp.get("fsdp_sync_module_states")):
        c.error(
            "fsdp_config.fsdp_cpu_ram_efficient_loading",
            "needs fsdp_sync_module_states: true (ranks other than 0 would keep empty weights)",
            "add fsdp_sync_module_states: true",
        )
    if _as_bool(fsdp.get("fsdp_offload_params")):
        c.warn(
            "fsdp_config.fsdp_offload_params",
            "CPU offload makes each step several times slower",
            "use it only when zero3 does not fit, even with activation checkpointing",
        )

    return version, strategy, sd_type, wrap


def _check_processes(c: _Checker, raw: dict, fsdp: dict, pc: dict, version, strategy) -> None:
    """Processes, machines, hybrid sharding."""
    for key, where in (("fsdp_min_num_params", fsdp), ("main_process_port", raw), ("machine_rank", raw)):
        value = where.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            name = f"fsdp_config.{key}" if where is fsdp else key
            c.error(
                name,
                f"{value!r} is not a non-negative integer (accelerate would fail on it at launch)",
                f"write {key} as a plain number, e.g. 100000000",
            )
    procs, machines = raw.get("num_processes", -1), raw.get("num_machines", 1)
    if "num_processes" not in raw:
        c.error("num_processes", "missing", "set it to the total number of GPUs over all machines")
    elif isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        c.error(
            "num_processes",
            f"{procs!r} is not a positive integer",
            "set it to the total number of GPUs over all machines",
        )
    elif not isinstance(machines, int) or machines < 1:
        c.error("num_machines", f"{machines!r} is not a positive integer", "set it to the number of nodes")
    else:
        if procs % machines:
            c.error(
                "num_processes",
                f"{procs} processes do not split evenly over {machines} machines",
                "set num_processes = num_machines x GPUs per machine",
            )
        rank = raw.get("machine_rank", 0)
        if isinstance(rank, int) and not 0 <= rank < machines:
            c.error("machine_rank", f"{rank} is not in 0..{machines - 1}", "pass --machine_rank on each node")
        hybrid = strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") if version == 1 else bool(pc)
        if version == 1 and hybrid and machines == 1:
            single = "SHARD_GRAD_OP" if "ZERO2" in str(strategy) else "FULL_SHARD"
            c.warn(
                "fsdp_config.fsdp_sharding_strategy",
                f"{strategy} on one machine behaves as {single}",
                f"use {'zero2' if single == 'SHARD_GRAD_OP' else 'zero3'}.yaml on one node, or set num_machines",
            )
        if version == 1 and hybrid and machines > 1 and procs == machines:
            c.error(
                "fsdp_config.fsdp_sharding_strategy",
                f"{strategy} with one process per machine would train every machine alone: "
                "torch runs a node of one process as NO_SHARD and reduces no gradient across nodes",
                "use accelerate_configs/fsdp1/zero3.yaml (or ddp.yaml), or run one process per GPU",
            )
        if version == 2 and pc and (sizes := _mesh_sizes(c, pc)):
            rep, shard, tp, cp = sizes
            other = tp * cp
            if rep * shard * other != procs:
                c.error(
                    "parallelism_config",
                    f"dp_replicate_size x dp_shard_size = {rep} x {shard} (x tp x cp {other}) is not num_processes {procs}",
                    "make dp_replicate_size = num_machines and dp_shard_size = GPUs per machine",
                )
            elif shard == 1 and cp == 1:
                c.error(
                    "parallelism_config.parallelism_config_dp_shard_size",
                    "1 leaves FSDP nothing to shard across (accelerate refuses it)",
                    "use dp_shard_size >= 2",
                )
            if rep > 1 and machines > 1 and rep != machines:
                c.warn(
                    "parallelism_config.parallelism_config_dp_replicate_size",
                    f"{rep} replicas over {machines} machines: shard groups then span nodes",
                    "set dp_replicate_size = num_machines",
                )


MESH_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")  # parallelism_config_<name>, 1 when unset


def _mesh_sizes(c: _Checker, pc: dict) -> tuple[int, ...] | None:
    """parallelism_config's mesh sizes, or None after an error for each one that is not a whole number >= 1.
    Text such as "2" is taken, as accelerate does (it passes the sizes on as environment variables)."""
    sizes = []
    for name in MESH_SIZES:
        key = f"parallelism_config_{name}"
        value = 1 if pc.get(key) is None else pc[key]  # unset or null: accelerate's default
        try:
            size = int(value) if isinstance(value, str) else value
        except ValueError:
            size = None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            c.error(
                f"parallelism_config.{key}",
                f"{value!r} is not a whole number of at least 1",
                f"write {key} as a number, e.g. 2",
            )
            size = None
        sizes.append(size)
    return None if None in sizes else tuple(sizes)


def _check_with_recipe(
    c: _Checker, recipe: dict, recipe_file: str, fsdp: dict, version, sd_type, mp, ddp: bool
) -> None:
    ac_fsdp = _as_bool(fsdp.get("fsdp_activation_checkpointing"))
    for key in ("gradient_checkpointing", "activation_checkpointing"):
        if ac_fsdp and _as_bool(recipe.get(key)):
            c.error(
                key,
                "is on together with the accelerate config's fsdp_activation_checkpointing: layers would be checkpointed twice (transformers refuses it)",
                f"drop {key} from the recipe, or set fsdp_activation_checkpointing: false",
                file=recipe_file,
            )
    if _as_bool(recipe.get("save_only_model")):  # under every config: its checkpoints are models, no run resumes them
        c.error("save_only_model", *SAVE_ONLY_MODEL, file=recipe_file)
    # QLoRA: FSDP shards the packed 4-bit weights as plain tensors (DDP replicates them as they are: any storage works)
    if _as_bool(recipe.get("load_in_4bit")) and not ddp:
        storage = recipe.get("bnb_4bit_quant_storage") or "uint8"
        weights = recipe.get("dtype") or "float32"
        if version == 2 and storage == "uint8":
            c.error(
                "bnb_4bit_quant_storage",
                "uint8 storage under FSDP2: fully_shard would shard the packed bytes as "
                "parameters of their own dtype beside the model's others",
                "set bnb_4bit_quant_storage to the model's dtype (bfloat16)",
                file=recipe_file,
            )
        elif storage != weights:
            c.error(
                "bnb_4bit_quant_storage",
                f"{storage} differs from the other parameters' dtype {weights}: FSDP flattens "
                "a unit's parameters into one dtype and refuses (FSDP1) or mis-shards (FSDP2) the mix",
                "set bnb_4bit_quant_storage and dtype to the same dtype, e.g. both bfloat16",
                file=recipe_file,
            )
    if recipe.get("dtype") in ("bfloat16", "float16") and not _as_bool(
        recipe.get("load_in_4bit")
    ):  # QLoRA: the base is frozen
        c.warn(
            "dtype",
            f"{recipe['dtype']} keeps the master weights and the optimizer state in 16 bits: updates smaller than "
            "their precision are rounded away",
            "keep dtype: float32 and set mixed_precision: bf16 in the accelerate config "
            "(FSDP computes in bf16, keeps fp32 master weights)",
            file=recipe_file,
        )
    if recipe.get("fp16") and mp == "bf16" or recipe.get("bf16") and mp == "fp16":
        c.error(
            "fp16" if recipe.get("fp16") else "bf16",
            f"disagrees with the accelerate config's mixed_precision: {mp}",
            "set mixed precision in one place: the accelerate config",
            file=recipe_file,
        )
    if version == 2 and (problem := unsteppable_optimizer(recipe.get("optim"))):
        c.error("optim", *problem, file=recipe_file)
    if _as_bool(recipe.get("cpu_bf16")) and mp != "bf16" and not _as_bool(recipe.get("bf16")):
        c.error(
            "cpu_bf16",
            f"keeps bf16 mixed precision on a CPU without native bf16, and mixed_precision is {mp}",
            "drop cpu_bf16, or set mixed_precision: bf16 in the accelerate config",
            file=recipe_file,
        )


def _check_model(c: _Checker, fsdp: dict, wrap, sd_type, model: str, trust_remote_code: bool = False) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.config.model_source import (
        config_size_problem,
        custom_code,
        hub_config_problem,
        model_source_problem,
        remote_code_problem,
    )

    source = str(Path(model).parent) if model.endswith(".json") else model
    if (
        source == model
        and Path(model).is_dir()
        and not (Path(model) / "config.json").is_file()
        and (problem := model_source_problem(model, weights=True))
    ):
        why, _, fix = problem.partition(": ")
        c.error("model", f"{model} {why}", fix or "give the folder that holds the model's config.json")
        return
    if problem := hub_config_problem(source):  # the checks need its config; nothing here can fetch it
        c.warn("model", f"{model} {problem[0]}; model checks skipped", problem[1])
        return
    if problem := remote_code_problem(source, trust_remote_code) or config_size_problem(source):
        c.error("model", f"{model} {problem[0]}", problem[1])
        return
    if trust_remote_code and (entries := custom_code(source)[0]):
        c.warn(
            "trust_remote_code",
            f"runs the Python files {model}'s config.json names ({', '.join(entries[:3])}) in every "
            "process, with your permissions",
            "keep it only for code you have read; models transformers has need none",
        )
    try:
        config = AutoConfig.from_pretrained(
            source, trust_remote_code=trust_remote_code
        )  # False: never prompts, never runs code
    except (OSError, ValueError) as err:
        c.warn(
            "model",
            f"could not read the config of {model!r} ({type(err).__name__}); model checks skipped",
            "give a local folder or config.json",
        )
        return
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    classes = {type(m).__name__ for m in skeleton.modules()}
    layer = next(iter(sorted(getattr(skeleton, "_no_split_modules", None) or [])), None)
    wanted = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if wrap == "TRANSFORMER_BASED_WRAP" and wanted:
        for name in [w.strip() for w in str(wanted).split(",") if w.strip()]:
            if name not in classes:
                fix = f"use {layer}, {type(skeleton).__name__}'s decoder layer" if layer else _suggest(name, classes)
                c.error(
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    f"{name!r} is not a module class of {type(skeleton).__name__}",
                    fix,
                )
    params = sum(p.numel() for p in skeleton.parameters())
    if sd_type == "FULL_STATE_DICT" and params > LARGE_MODEL:
        c.warn(
            "fsdp_config.fsdp_state_dict_type",
            f"FULL_STATE_DICT gathers all {params / 1e9:.1f}B parameters on rank 0 at every save",
            "use SHARDED_STATE_DICT and tools/merge_checkpoint.py",
        )


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.level == "error"]
