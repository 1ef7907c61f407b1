"""Check an accelerate FSDP config (with its recipe and model) before it wastes a cluster (tools/check_config.py,
and every launch): ``check_config`` for a file, ``check_settings`` for settings already read.

Every problem at once, each with the file, the key, what is wrong and the fix. Errors make the check fail;
warnings are settings that work but cost, or that accelerate will silently ignore. The valid keys come from
accelerate itself (its config dataclass and its launch parser), so they follow the pinned version. The
fsdp_config section's rules are fsdp_recipes.config.fsdp_section's; the config against the recipe and the model,
fsdp_recipes.config.recipe_checks'.
"""

from __future__ import annotations

import os

from fsdp_recipes.bounded import YAML_LIMIT, load_json, load_yaml
from fsdp_recipes.config.flags import known_accelerate_keys
from fsdp_recipes.config.fsdp_section import check_fsdp_keys
from fsdp_recipes.config.problems import Checker, Problem, as_bool, suggest
from fsdp_recipes.config.recipe_checks import ZERO1_UNDER_FSDP, check_model, check_with_recipe

# accelerate's distributed types for DistributedDataParallel
from fsdp_recipes.config.strategy import DDP_TYPES
from fsdp_recipes.errors import UnreadableFile

MIXED_PRECISION = ["no", "fp16", "bf16", "fp8"]
ACCELERATE_AS_RECIPE = "is an accelerate config"


def _recipe_keys() -> set[str]:
    """The keys a training recipe sets (its argument dataclasses' and TrainingArguments' fields)."""
    import dataclasses

    from transformers import TrainingArguments

    from fsdp_recipes.config.arguments import DataArguments
    from fsdp_recipes.config.model_arguments import ModelArguments
    from fsdp_recipes.config.run_arguments import RunArguments

    return {
        f.name
        for cls in (ModelArguments, DataArguments, RunArguments, TrainingArguments)
        for f in dataclasses.fields(cls)
    }


def recipe_keys_problem(recipe: dict, known: set[str], path) -> tuple[str, str] | None:
    """(what is wrong, the fix) when a recipe (its TRL names already taken: trl_names.rename_recipe_keys) has keys
    no recipe takes; None when it has none. An accelerate config given as the recipe (accelerate's keys and none
    only a recipe has) is said to be one, with where it goes, not listed key by key. train_fsdp.py and
    tools/check_config.py --recipe say the same."""
    from fsdp_recipes.config.trl_names import UNKNOWN_FIX, unknown_keys

    unknown = sorted(set(recipe) - known)
    if not unknown:
        return None
    top = known_accelerate_keys()[0]
    theirs = sorted(set(recipe) & (top - known))
    if theirs and not set(recipe) & (known - top):
        return (
            f"{ACCELERATE_AS_RECIPE} ({', '.join(theirs[:3])}{', ...' if len(theirs) > 3 else ''}), not a "
            "training recipe",
            f"pass it as accelerate launch --config_file {path} train_fsdp.py, and give train_fsdp.py a recipe "
            "(recipes/) or none",
        )
    return unknown_keys(unknown, known), UNKNOWN_FIX


def read_config_file(path: str | os.PathLike) -> dict:
    """An accelerate config file's mapping as accelerate reads it: within bounds (fsdp_recipes.bounded), a .json file
    as JSON (accelerate json.loads it: tabs and all), then the keys accelerate converts converted by its own
    ClusterConfig.process_config (``fp16`` to mixed_precision, a top-level ``dynamo_backend`` to dynamo_config) and a
    null mixed_precision taken as accelerate launch takes it, "no"."""
    from accelerate.commands.config.config_args import ClusterConfig

    if str(path).endswith(".json"):
        raw = load_json(path, "accelerate config", YAML_LIMIT)
    else:
        raw = load_yaml(path, "accelerate config")
    if "dynamo_backend" in raw and raw.get("dynamo_config"):
        raise UnreadableFile(
            path,
            "accelerate config",
            "has both a top-level dynamo_backend and a dynamo_config: accelerate keeps the first and drops every key "
            "of the second",
            "put the backend under dynamo_config as dynamo_backend",
        )
    # process_config refuses a mapping without distributed_type: the checks name that one themselves
    read = ClusterConfig.process_config({**raw, "distributed_type": raw.get("distributed_type")})
    # the keys it converts, not the defaults it fills in (missing keys keep meaning accelerate's defaults)
    converted = {"mixed_precision", "dynamo_config"} - set(raw)
    return {
        key: value
        for key, value in read.items()
        if (key in raw or key in converted) and not (key == "mixed_precision" and value is None)
    }


def check_config(
    config_path: str | os.PathLike,
    recipe_path: str | os.PathLike | None = None,
    model: str | None = None,
    recipe: dict | None = None,
) -> list[Problem]:
    """All problems of an accelerate config, alone or with a recipe YAML (or its parsed dict) and a model.

    ``model``: a hub id, a local folder or a config.json; only its config is read (on the meta device).
    """
    c = Checker(str(config_path))
    # within bounds (fsdp_recipes.bounded): no folder, pipe, device, oversize or binary file, no YAML aliases
    try:
        raw = read_config_file(config_path)
        if recipe is None and recipe_path is not None:
            recipe = load_yaml(recipe_path, "recipe")
    except UnreadableFile as err:
        c.error("", err.reason, err.fix, file=err.path)
        return c.problems
    # accelerate itself fails on an empty file with an AttributeError
    if not raw:
        c.error("", "is empty: it holds no accelerate config", "copy one of accelerate_configs/ (zero3.yaml)")
    # train_fsdp.py refuses it: no model_name_or_path nor config_name
    if recipe_path is not None and not recipe:
        c.error(
            "",
            "is empty: it names no model (model_name_or_path or config_name), which train_fsdp.py then needs as a flag",
            "write the recipe, or leave it out for the embedded default",
            file=str(recipe_path),
        )
    if c.problems:
        return c.problems
    if recipe_path is not None and (problem := _recipe_problem(recipe, recipe_path)):
        c.error("", *problem, file=str(recipe_path))
        # the recipe's settings are none: nothing to check the config against
        if ACCELERATE_AS_RECIPE in problem[0]:
            return c.problems
    return c.problems + check_settings(raw, str(config_path), recipe, str(recipe_path or "recipe"), model)


def _recipe_problem(recipe: dict, path) -> tuple[str, str] | None:
    """The recipe file's keys as train_fsdp.py takes them (TRL's and the handbook's names included)."""
    from fsdp_recipes.config import trl_recipe
    from fsdp_recipes.config.trl_names import rename_recipe_keys
    from fsdp_recipes.errors import RecipeError

    try:
        recipe = rename_recipe_keys(trl_recipe.translate(recipe, tell=lambda line: None))
    except RecipeError as err:
        return str(err), "fix the recipe (train_fsdp.py refuses it as it is)"
    return recipe_keys_problem(recipe, _recipe_keys(), path)


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
    c = Checker(label)
    recipe = recipe or {}
    top, fsdp_keys, pc_keys = known_accelerate_keys()
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
    # every other check reads these mappings: what it would say follows from this alone
    if c.problems:
        return c.problems
    # a recipe as the config: one line, not one per key
    if check_keys and raw and not set(raw) & top and set(raw) & _recipe_keys():
        c.error(
            "",
            "holds none of accelerate's config keys (it has "
            f"{', '.join(sorted(raw)[:4])}{', ...' if len(raw) > 4 else ''}): "
            "it is not an accelerate config",
            "give an accelerate config first (accelerate_configs/zero3.yaml); a training recipe goes after --recipe",
        )
        return c.problems
    for key in raw if check_keys else ():
        if key not in top:
            c.error(key, "unknown key (accelerate refuses the file)", suggest(key, top))
    for key in fsdp if check_keys else ():
        if key not in fsdp_keys:
            c.error(f"fsdp_config.{key}", "unknown key (accelerate would silently ignore it)", suggest(key, fsdp_keys))
    for key in pc if check_keys else ():
        if key not in pc_keys:
            c.error(
                f"parallelism_config.{key}", "unknown key (accelerate would silently ignore it)", suggest(key, pc_keys)
            )
    if check_keys:
        _check_dynamo(c, raw.get("dynamo_config"))

    if raw.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
        c.error(
            "compute_environment",
            f"is {raw['compute_environment']!r}: accelerate launches such a config on Amazon SageMaker, with "
            "SageMaker's keys, not on this machine or cluster",
            "set compute_environment: LOCAL_MACHINE",
        )
    dist_type = raw.get("distributed_type")
    # accelerate_configs/ddp.yaml: DDP, and ZeRO-1 with the recipe's zero1
    ddp = dist_type in DDP_TYPES and not fsdp
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
        version, strategy, sd_type, wrap = check_fsdp_keys(c, fsdp)
        if as_bool(recipe.get("zero1")):
            c.error(
                "zero1",
                ZERO1_UNDER_FSDP,
                "drop zero1 (FSDP shards the optimizer state already), or launch with accelerate_configs/ddp.yaml",
                file=recipe_file,
            )
    _check_processes(c, raw, fsdp, pc, version, strategy)
    check_with_recipe(c, recipe, recipe_file, fsdp, version, sd_type, mp, ddp)
    _check_compile(c, raw, recipe, recipe_file, version)

    # ----- with the model -----
    model = model or recipe.get("model_name_or_path") or recipe.get("config_name")
    if model and not ddp:
        revision = recipe.get("model_revision") if model == recipe.get("model_name_or_path") else None
        trust = bool(as_bool(recipe.get("trust_remote_code")))
        check_model(c, fsdp, wrap, sd_type, model, trust, None if revision in (None, "main") else str(revision))
    return c.problems


COMPILE_UNDER_FSDP1 = (
    "compiles the model, which FSDP1 cannot run here (accelerate's compilation fails on its wrapper)",
    "compile under FSDP2 (accelerate_configs/zero3.yaml), or drop the compilation",
)


def compile_asked(settings: dict, dynamo: dict | None = None) -> str | None:
    """The setting that asks to compile the model, or None: accelerate's dynamo backend in ``dynamo`` (a config's
    dynamo_config, its keys with or without the dynamo_ prefix accelerate adds), else transformers' torch_compile in
    ``settings`` (a backend or a mode turns it on, even an empty one)."""
    for key in ("dynamo_backend", "backend"):
        if str((dynamo or {}).get(key) or "no").lower() != "no":
            return f"dynamo_config.{key}"
    if settings.get("torch_compile") not in (None, "") and as_bool(settings.get("torch_compile")) is not False:
        return "torch_compile"
    return next((k for k in ("torch_compile_backend", "torch_compile_mode") if settings.get(k) is not None), None)


def compile_modes() -> list[str]:
    """The modes torch.compile takes (torch._inductor's own list): another is a RuntimeError on every rank."""
    from fsdp_recipes.compat import internals

    return list(internals.get("torch._inductor.list_mode_options")())


def _check_dynamo(c: Checker, dynamo) -> None:
    """dynamo_config against what accelerate's launcher does with it: it copies each key to its --dynamo_* option
    (the dynamo_ prefix added where missing), so a key without one is ignored without a word, and it reads the
    backend as a DynamoBackend, failing with a traceback on any other name."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DynamoBackend

    if dynamo is None:
        return
    if not isinstance(dynamo, dict):
        c.error("dynamo_config", "must be a mapping", "indent the dynamo_* keys under dynamo_config:")
        return
    options = {a.dest: a for a in launch_command_parser()._actions if a.dest.startswith("dynamo_")}
    backends = [b.value.lower() for b in DynamoBackend]
    for key, value in dynamo.items():
        name, where = str(key) if str(key).startswith("dynamo_") else f"dynamo_{key}", f"dynamo_config.{key}"
        if name not in options:
            c.error(where, "unknown key (accelerate would silently ignore it)", suggest(key, options))
        elif name == "dynamo_backend" and value is not None and str(value).lower() not in backends:
            c.error(
                where,
                f"{value!r} is not a backend accelerate knows",
                f"give one of {', '.join(backends)} (inductor compiles; no turns compilation off)",
            )
        # the ranks read it with str_to_bool
        elif options[name].nargs == 0 and not _truth_value(value):
            c.error(where, f"{value!r} is not true or false", "give true or false")
        # "": default
        elif name == "dynamo_mode" and value not in (None, "") and str(value) not in compile_modes():
            c.error(where, f"{value!r} is not a mode torch.compile knows", f"give one of {', '.join(compile_modes())}")


def _truth_value(value) -> bool:
    """Whether accelerate's str_to_bool, which a rank applies to the launcher's str() of the value, reads it."""
    from accelerate.utils import str_to_bool

    try:
        str_to_bool(str(value))
    except ValueError:
        return False
    return True


def _check_compile(c: Checker, raw: dict, recipe: dict, recipe_file: str, version) -> None:
    """Compilation under FSDP1: accelerate's regional compilation recurses into the FSDP1 wrapper on every rank, and
    a whole-model torch.compile wraps FSDP1 in a module no FSDP check recognises. FSDP2 compiles either way."""
    dynamo = raw.get("dynamo_config") if isinstance(raw.get("dynamo_config"), dict) else {}
    if version == 1 and (asked := compile_asked(recipe, dynamo)):
        c.error(asked, *COMPILE_UNDER_FSDP1, file=None if asked.startswith("dynamo_config") else recipe_file)


def _check_processes(c: Checker, raw: dict, fsdp: dict, pc: dict, version, strategy) -> None:
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
                    f"dp_replicate_size x dp_shard_size = {rep} x {shard} (x tp x cp {other}) is not "
                    f"num_processes {procs}",
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


# parallelism_config_<name>, 1 when unset
MESH_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")


def _mesh_sizes(c: Checker, pc: dict) -> tuple[int, ...] | None:
    """parallelism_config's mesh sizes, or None after an error for each one that is not a whole number >= 1.
    Text such as "2" is taken, as accelerate does (it passes the sizes on as environment variables)."""
    sizes = []
    for name in MESH_SIZES:
        key = f"parallelism_config_{name}"
        # unset or null: accelerate's default
        value = 1 if pc.get(key) is None else pc[key]
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
