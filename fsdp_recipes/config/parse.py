"""``train_fsdp.py [recipe.yaml] [--flag value ...]`` read into the argument dataclasses and a Plan: a recipe YAML
sets the defaults, command-line flags win. Reads and decides only (fsdp_recipes.train.preflight acts on the Plan)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fsdp_recipes.bounded import load_yaml
from fsdp_recipes.ckpt.resume import check_output_dir, explicit, requested
from fsdp_recipes.compat import cpu_fsdp
from fsdp_recipes.config import batch_size, helptext, launcher, trl_recipe
from fsdp_recipes.config.accelerate_config import (
    ACCELERATE_AS_RECIPE,
    COMPILE_UNDER_FSDP1,
    compile_asked,
    recipe_keys_problem,
)
from fsdp_recipes.config.arguments import DataArguments, build
from fsdp_recipes.config.dict_fields import check_dict_valued
from fsdp_recipes.config.flags import by_option, check_recipe_types, parse_flags
from fsdp_recipes.config.hub_push import push_plan
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.config.packages import check_deepspeed, check_packages
from fsdp_recipes.config.plan import Plan
from fsdp_recipes.config.recipe_checks import ZERO1_UNDER_FSDP
from fsdp_recipes.config.run_arguments import RunArguments
from fsdp_recipes.config.trainer_fsdp import check_trainer_fsdp
from fsdp_recipes.config.trl_names import check_flag_aliases, check_unknown_flags, rename_recipe_keys
from fsdp_recipes.config.values import best_metric_direction, check_task_flags, check_training_values
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError, UnreadableFile
from fsdp_recipes.tiny import REPO_ROOT

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "tiny-llama" / "pretrain.yaml"


# Keys of the embedded default recipe that point into this repository: anchored here so the default
# runs from any working directory. Paths in user recipes stay relative to the working directory.
_REPO_PATH_KEYS = ("config_name", "tokenizer_name", "model_name_or_path", "train_file")


# Keys holding a path, where a quoted or recipe-written ~ reaches us unexpanded (no shell saw it): os.makedirs('~/x')
# would make a folder named ~ in the working directory. A hub id never starts with ~.
PATH_KEYS = (
    "output_dir",
    "logging_dir",
    "model_name_or_path",
    "config_name",
    "tokenizer_name",
    "train_file",
    "validation_file",
    "resume_from_checkpoint",
    "fsdp_config",
    "accelerator_config",
)


def expand_home(raw) -> None:
    """A leading ~ or ~user in every path key of ``raw``, expanded as a shell would; one nobody's home is refused."""
    for key in PATH_KEYS:
        value = getattr(raw, key, None)
        if not (isinstance(value, str) and value.startswith("~")):
            continue
        expanded = os.path.expanduser(value)
        # ~name of no user, or no home known (HOME unset, no passwd entry)
        if expanded.startswith("~"):
            raise RecipeError(f"{key}={value!r}: {value.split('/')[0]} is no home folder here: give the full path")
        setattr(raw, key, expanded)


def load_recipe(path: Path, anchor_paths: bool = False) -> dict:
    """The recipe's mapping, read within bounds (fsdp_recipes.bounded: no folder, pipe, device, oversize or binary
    file, no YAML aliases); every refusal is a RecipeError naming the file and the fix."""
    if not os.path.lexists(path):
        raise RecipeError(
            f"recipe {str(path)!r} does not exist: give a YAML file such as {DEFAULT_RECIPE.relative_to(REPO_ROOT)}"
        )
    try:
        recipe = load_yaml(path, "recipe")
    except UnreadableFile as err:
        raise RecipeError(str(err)) from None
    if anchor_paths:
        for key in _REPO_PATH_KEYS:
            if isinstance(recipe.get(key), str) and not Path(recipe[key]).is_absolute():
                recipe[key] = str(REPO_ROOT / recipe[key])
    return recipe


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, Plan]:
    """``[recipe.yaml] [--flag value ...]``; with no recipe, the embedded default recipe is used.

    Reads and checks only: no file is moved, nothing is patched, no process group is joined. What the run then
    does before loading anything (build TrainingArguments, which joins the process group; decide the resume once,
    on rank 0; take output_dir; set checkpoints aside) is the returned Plan, carried out by
    fsdp_recipes.train.preflight. Bad input therefore fails on each rank in seconds and leaves nothing behind; a
    resume's checkpoint is judged in the preflight, as soon as the group exists.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    helptext.quiet_unless_first(argv)
    parser = helptext.build_parser(show_all="--help-all" in argv)
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        recipe_path = argv.pop(0)
        recipe = load_recipe(Path(recipe_path).expanduser())
    elif argv and not argv[0].startswith("-"):
        raise RecipeError(f"{argv[0]!r} is not a recipe: give a .yaml file first, then --flags")
    else:
        recipe_path, recipe = DEFAULT_RECIPE, load_recipe(DEFAULT_RECIPE, anchor_paths=True)
    argv = trl_recipe.translate_flags(argv)
    # TRL's and the handbook's keys, TRL's meaning
    recipe = rename_recipe_keys(trl_recipe.translate(recipe, argv))
    if problem := recipe_keys_problem(recipe, {action.dest for action in parser._actions}, recipe_path):
        # an accelerate config names its file; unknown keys are the recipe's
        what, fix = problem
        raise RecipeError(
            f"{recipe_path} {what}: {fix}" if what.startswith(ACCELERATE_AS_RECIPE) else f"recipe: {what}: {fix}"
        )
    # before its type check: a mapping there is DeepSpeed's too
    check_deepspeed(recipe.get("deepspeed"))
    # on the values as typed: auto, not the placeholder
    check_flag_aliases(argv, parser)
    # 1 until the preflight chooses
    recipe, argv, auto_batch = batch_size.take_auto(recipe, argv)
    check_recipe_types(recipe, parser)
    # --output-dir too
    options = by_option(parser)
    given = {options[a.split("=", 1)[0]].dest for a in argv if a.split("=", 1)[0] in options}
    for pair in (("model_name_or_path", "config_name"), ("dataset_name", "train_file")):
        # a source on the command line replaces the recipe's, whichever kind it is
        if given & set(pair):
            for key in set(pair) - given:
                recipe.pop(key, None)
    # the keys a flag or the recipe set, as against argparse's defaults
    set_keys = given | set(recipe)
    parser.set_defaults(**recipe)
    # plain values: no dataclass, no process group yet
    raw, extras = parse_flags(parser, argv)
    check_unknown_flags(extras, parser)
    expand_home(raw)
    # transformers would import them on every rank after start-up, and fail there
    check_packages(raw)
    # the torchrun route: TrainingArguments' own --fsdp
    trainer_fsdp = check_trainer_fsdp(raw)
    # the other dict-valued fields, in every form
    check_dict_valued(raw)
    if problem := cpu_fsdp.single_process_problem(trainer_fsdp):
        raise RecipeError(problem)
    plan = Plan(raw, trainer_fsdp, launch=launcher.check_launch(raw), auto_batch=auto_batch)
    if trainer_fsdp and plan.launch is not None and plan.launch.config.get("distributed_type") == "FSDP":
        # the Trainer's --fsdp won over the config: the run trained otherwise than its config, and run_args.json said
        raise RecipeError(
            f"--fsdp (TrainingArguments' FSDP, for torchrun without accelerate) and {plan.launch.describe()}'s "
            "FSDP are both given: set FSDP in one place, the accelerate config (or its launch flags, e.g. "
            "--fsdp_sharding_strategy): drop fsdp and fsdp_config"
        )
    # every launch of FSDP1 (accelerate's variables, however set): a compile the config checks above did not name
    version = os.environ.get("FSDP_VERSION", "1")
    if cpu_fsdp.fsdp_requested() and version == "1" and not trainer_fsdp:
        if asked := compile_asked(vars(raw), {"dynamo_backend": os.environ.get("ACCELERATE_DYNAMO_BACKEND")}):
            asked = "ACCELERATE_DYNAMO_BACKEND" if asked.startswith("dynamo_config") else asked
            raise RecipeError(f"{asked} {COMPILE_UNDER_FSDP1[0]}; fix: {COMPILE_UNDER_FSDP1[1]}")
    model_args, data_args, run_args = (build(cls, raw) for cls in (ModelArguments, DataArguments, RunArguments))
    check_training_values(raw, model_args, data_args)
    check_task_flags(raw, data_args, explicit=set_keys)
    best_metric_direction(raw, explicit=set_keys)
    plan.run_args = run_args
    output_dir = raw.output_dir or "trainer_output"
    # Which checkpoint a resume uses (reading its files), what it sets aside and the requeue record are decided once
    # per launch, on global rank 0 after the process group starts (fsdp_recipes.train.preflight.decide_resume): here
    # each rank would read every rank's files, and could see another newest checkpoint than its peers.
    # no file read
    if (path := explicit(raw.resume_from_checkpoint)) is not None and not (path.strip() and Path(path).is_dir()):
        raise RecipeError(
            f"--resume_from_checkpoint {path!r} is not a folder: give a checkpoint-N folder, or true for the latest"
        )
    inputs = {
        "model_name_or_path": model_args.model_name_or_path,
        "config_name": model_args.config_name,
        "tokenizer_name": model_args.tokenizer_name,
    }
    plan.delete = check_output_dir(
        output_dir,
        resuming=requested(raw.resume_from_checkpoint),
        overwrite=run_args.overwrite_output_dir,
        resume=explicit(raw.resume_from_checkpoint),
        inputs=inputs,
    )
    fsdp = cpu_fsdp.fsdp_requested() or trainer_fsdp
    if not fsdp and not run_args.allow_no_fsdp and not (plan.launch is not None and plan.launch.ddp):
        raise RecipeError(launcher.no_fsdp_problem())
    if run_args.zero1 and cpu_fsdp.launched_world_size() < 2:
        raise RecipeError(
            "zero1 shards the optimizer state across processes and this launch has 1: launch with "
            "--config_file accelerate_configs/ddp.yaml (2+ processes), or drop zero1"
        )
    # the accelerate-launch route is named by the config check above, by file and key
    if run_args.zero1 and fsdp:
        raise RecipeError(f"zero1 {ZERO1_UNDER_FSDP}: drop zero1, or launch with accelerate_configs/ddp.yaml")
    # last: it asks the hub. The Trainer's own push would upload output_dir at every save (hub_push's docstring)
    plan.push = push_plan(raw, explicit=set_keys)
    raw.push_to_hub = False
    for line in (
        launcher.unused_accelerators_warning(),
        launcher.one_process_note(plan.launch, cpu_fsdp.launched_world_size()),
    ):
        if line:
            say(line)
    return model_args, data_args, plan
