"""What train_fsdp.py does between checking its input and loading anything: the preflight section.

Argument parsing (fsdp_recipes.config.parse) only reads and decides; it never moves a file, patches torch or joins
a process group, so bad input fails on every rank in seconds and changes nothing. Once every check has passed,
the Plan it returns (fsdp_recipes.config.plan) is carried out here, in this order:

1. ``start``: make FSDP (or DDP) real where there is no accelerator (fsdp_recipes.compat.cpu_fsdp), build
   TrainingArguments, which starts accelerate's PartialState and joins the process group; choose
   per_device_train_batch_size where the run asked for auto (fsdp_recipes.config.batch_size);
2. ``decide_resume``: one resume decision for the launch (fsdp_recipes.ckpt.resume.decide: which checkpoint, what
   to set aside, the requeue record), made on global rank 0, which alone reads the checkpoints' files; every rank
   takes it, after checking from folder names that it sees what rank 0 saw;
3. ``hold_output_dir``: one run per output_dir at a time (fsdp_recipes.train.run_lock: a POSIX lock held by
   global rank 0 while it lives, or a lock file where the filesystem has no POSIX locks);
4. ``apply``: on rank 0, set aside incomplete or superseded checkpoints and delete those --overwrite_output_dir
   named; every rank waits for it;
5. ``save_resolved_arguments``: the arguments in force (model, data, training, and the accelerate config) as
   ``output_dir/run_args.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from fsdp_recipes import console
from fsdp_recipes.bounded import YAML_LIMIT, read_text
from fsdp_recipes.ckpt.dcp_pickles import guard_torch_dcp
from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE, RUN_RECORD, is_checkpoint_folder
from fsdp_recipes.ckpt.resume import REQUEUE_RECORD, decide, disagreement, requested, sight
from fsdp_recipes.ckpt.rotation import set_aside
from fsdp_recipes.compat import cpu_fsdp
from fsdp_recipes.config.arguments import build
from fsdp_recipes.config.batch_size import choose_for_run
from fsdp_recipes.config.fsdp_section import STRATEGIES
from fsdp_recipes.config.launcher import LaunchSettings
from fsdp_recipes.config.plan import Plan
from fsdp_recipes.config.strategy import fsdp1_hybrid_problem
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.removal import remove
from fsdp_recipes.train import run_lock

# its presence marks an output_dir as a run of ours (ckpt.layout.foreign_entries)
ARGS_NAME = RUN_RECORD


def start(plan: Plan):
    """Patch (CPU only) and build TrainingArguments: this joins the process group. Returns TrainingArguments and
    what runs over gloo where there is no accelerator: "FSDP", "DDP" or None (an accelerator, or one process)."""
    from transformers import TrainingArguments

    # a resume's DCP load unpickles nothing our allow-lists have not vetted
    guard_torch_dcp()
    # both must precede TrainingArguments, which creates accelerate's PartialState
    on_cpu = "FSDP" if cpu_fsdp.enable(plan.trainer_fsdp) else "DDP" if cpu_fsdp.enable_ddp(plan.trainer_fsdp) else None
    raw = plan.raw
    # before TrainingArguments, which reads the mixed precision: fp32 on a CPU without native bf16 (the script says so)
    precision = cpu_fsdp.choose_cpu_precision(
        bool(getattr(raw, "bf16", False)), bool(getattr(plan.run_args, "cpu_bf16", False))
    )
    if precision is not None and precision.mixed_precision == "no":
        raw.bf16 = False
    elif precision is not None and raw.bf16:
        # kept on a CPU with native bf16: the Trainer refuses bf16 without a GPU unless use_cpu (which drops FSDP),
        # so it reaches accelerate as the configs' mixed_precision: bf16 does, through the launcher's variable
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
        raw.bf16 = False
    if getattr(raw, "ddp_find_unused_parameters", None) is None:
        # the Trainer's default (True without gradient checkpointing) makes DDP walk the autograd graph every
        # step for parameters a causal LM always uses; torch warns about it on every rank. FSDP ignores it.
        raw.ddp_find_unused_parameters = False
    if not cpu_fsdp.accelerator_present():
        # nothing to pin to: torch warns once per DataLoader otherwise
        raw.dataloader_pin_memory = False
    try:
        training_args = build(TrainingArguments, raw)
    # TrainingArguments.__post_init__ checks
    except ValueError as err:
        raise RecipeError(str(err).replace("\n", " ")) from None
    # Every rank has joined before any acts on what it finds next: a rank that refuses at once and exits would
    # break a peer still connecting to it (gloo's "Connection closed by peer"), whose line would be gloo's, not ours.
    _barrier()
    training_args.resume_from_checkpoint = plan.resume
    runs = fsdp1_strategy(training_args)
    if problem := fsdp1_ignored_option(getattr(raw, "fsdp", None), runs) or fsdp1_hybrid_problem(
        runs, devices_per_process(), *_local_and_world()
    ):
        raise RecipeError(problem)
    if plan.auto_batch:
        # said by Run.build, with the training set's size (a batch larger than it is then named)
        training_args.per_device_train_batch_size = choose_batch_size(
            plan, training_args, say=lambda line: setattr(plan, "auto_line", line)
        )
    return training_args, on_cpu


def choose_batch_size(plan: Plan, training_args, say=say) -> int:
    """per_device_train_batch_size: auto (fsdp_recipes.config.batch_size), before anything is loaded: each rank
    chooses for its device and all take the smallest choice; rank 0 says it in one line."""
    raw = plan.raw
    try:
        batch, line = choose_for_run(
            raw.model_name_or_path or raw.config_name,
            plan.launch.config if plan.launch is not None else None,
            training_args,
            raw.block_size,
            zero1=bool(getattr(plan.run_args, "zero1", False)),
            revision=None if getattr(raw, "model_revision", "main") == "main" else raw.model_revision,
        )
    except ValueError as err:
        raise RecipeError(str(err)) from None
    smallest = min(_all_gather(batch))
    if training_args.process_index == 0:
        say(line if smallest == batch else f"{line}; another rank's device fits only {smallest}: every rank takes it")
    return smallest


def strategy_name(value) -> str:
    """An FSDP1 sharding strategy as accelerate takes it (a name in any case, its 1-based number, torch's enum)."""
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    # torch.distributed.fsdp.ShardingStrategy
    value = getattr(value, "name", value)
    text = str(value).strip()
    if text.isdigit() and 1 <= int(text) <= len(FSDP_SHARDING_STRATEGY):
        return FSDP_SHARDING_STRATEGY[int(text) - 1]
    # torch's private _HYBRID_SHARD_ZERO2 is accelerate's HYBRID_SHARD_ZERO2
    return text.upper().lstrip("_")


def fsdp1_strategy(training_args, env=None) -> str | None:
    """The FSDP1 sharding strategy this launch runs (None: not FSDP1), resolved as accelerate 1.15's plugin does:
    the plugin's sharding_strategy, else FSDP_SHARDING_STRATEGY from the environment (accelerate launch sets it
    from the config), else FULL_SHARD. On the torchrun route transformers passes the plugin its --fsdp option as
    reshard_after_forward, which accelerate's FSDP1 never reads (fsdp1_ignored_option)."""
    env = os.environ if env is None else env
    plugin_args = getattr(training_args, "fsdp_plugin_args", None) or {}
    if plugin_args:
        version = str(plugin_args.get("fsdp_version", 1)).strip()
    elif cpu_fsdp.fsdp_requested(env):
        version = env.get("FSDP_VERSION", "1").strip()
    else:
        return None
    if version != "1":
        return None
    chosen = plugin_args.get("sharding_strategy")
    return strategy_name(chosen if chosen is not None else env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD"))


def fsdp1_ignored_option(fsdp_option, runs: str | None) -> str | None:
    """The strategy the torchrun route's --fsdp names (e.g. "hybrid_shard auto_wrap") when FSDP1 would run ``runs``
    instead without a word: transformers hands it to accelerate as reshard_after_forward, and accelerate's FSDP1
    takes FSDP_SHARDING_STRATEGY (default FULL_SHARD); measured, --fsdp "hybrid_shard auto_wrap" ran FULL_SHARD."""
    words = (
        fsdp_option.split()
        if isinstance(fsdp_option, str)
        else [str(getattr(w, "value", w)) for w in fsdp_option or []]
        if isinstance(fsdp_option, (list, tuple))
        else []
    )
    # --fsdp's words, upper-cased
    named = [strategy_name(w) for w in words if strategy_name(w) in STRATEGIES]
    if runs is None or not named or named[0] == runs:
        return None
    return (
        f"--fsdp {named[0].lower()} would run as {runs}: accelerate's FSDP1 takes its strategy from "
        "FSDP_SHARDING_STRATEGY "
        f"(unset: FULL_SHARD), not from transformers' --fsdp option; set FSDP_SHARDING_STRATEGY={named[0]} in "
        "the launch's "
        "environment (and --fsdp true), or launch with accelerate launch --config_file "
        "accelerate_configs/fsdp1/<config>.yaml"
    )


def devices_per_process() -> int:
    """The device count FSDP1 groups HYBRID_SHARD ranks by: CUDA's, or on CPU the node's processes (cpu_fsdp)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else cpu_fsdp.cpu_devices_per_node()


def _local_and_world() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)), world


def decide_resume(plan: Plan, training_args=None, say=say) -> None:
    """The launch's one resume decision, into ``plan`` (resume, set_aside, requeue_record) and ``training_args``.

    Global rank 0 decides (fsdp_recipes.ckpt.resume.decide: every file of the checkpoints it weighs, each rank's
    RNG state once: O(world) reads in all) and broadcasts the decision. Every rank then reports what it sees from
    folder names alone (the newest checkpoint-N in output_dir, the chosen folder); when a rank sees otherwise than
    rank 0, all stop with the same line naming who saw what. Nothing is moved before this has passed (``apply``).
    Without a process group (one process) this is rank 0 alone."""
    value, output_dir = plan.raw.resume_from_checkpoint, plan.raw.output_dir or "trainer_output"
    decision = _broadcast(decide(value, output_dir, plan.trainer_fsdp) if _rank() == 0 else None)
    if requested(value):
        sights = _all_gather(sight(value, output_dir, decision.path))
        if problem := disagreement(value, output_dir, decision.path, sights):
            raise RecipeError(problem)
    if decision.error:
        for note in decision.notes:
            say(note)
        raise RecipeError(decision.error)
    # printed by apply, once output_dir is held: a second run refused there says nothing of the first run's checkpoints
    plan.notes = decision.notes
    plan.resume, plan.set_aside, plan.requeue_record = decision.path, decision.set_aside, decision.requeue_record
    if training_args is not None:
        training_args.resume_from_checkpoint = plan.resume


def apply(plan: Plan, training_args, say=say) -> None:
    """Rank 0 moves and deletes what the checks decided; the others wait for it."""
    if training_args.process_index == 0:
        carry_out(plan, say)
    _barrier()


def carry_out(plan: Plan, say=say) -> None:
    """The moves and deletions themselves, in this process (``apply`` runs it on rank 0 of a launch)."""
    for note in plan.notes:
        # stderr, as every check's line: not the log's stdout
        console.say(note)
    for path, prefix, why in plan.set_aside:
        if path.is_dir():
            say(f"{why}: moved {path.name} to {set_aside(path, prefix).name} (nothing deleted)")
    # checked by check_output_dir before anything started; checked again here
    for path in plan.delete:
        remove(path, CHECKPOINT_PURPOSE, shape=is_checkpoint_folder)
    if plan.requeue_record is not None:
        out = Path(plan.raw.output_dir or "trainer_output")
        (out / REQUEUE_RECORD).write_text(json.dumps(plan.requeue_record) + "\n")
    if plan.delete:
        say(
            f"--overwrite_output_dir: deleted {len(plan.delete)} checkpoint folder(s) of the earlier run in "
            f"{plan.delete[0].parent}"
        )


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather(value) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _broadcast(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def hold_output_dir(training_args, warn=say) -> None:
    """Take output_dir for this run (global rank 0 holds the lock: fsdp_recipes.train.run_lock); every rank stops
    alike when another run has it."""
    problem = None
    if training_args.process_index == 0:
        out = Path(training_args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        problem = run_lock.take(out, warn)
    problem = _broadcast(problem)
    if problem is not None:
        raise RecipeError(problem)


def has_run_record(training_args) -> bool:
    """output_dir holds a run record (a file): a resume into it may leave it as it is until its checks pass."""
    return (Path(training_args.output_dir) / ARGS_NAME).is_file()


def save_resolved_arguments(model_args, data_args, training_args, launch: LaunchSettings | None, push=None) -> None:
    """output_dir/run_args.json on rank 0: every argument in force, the accelerate config file's own text, the
    accelerate settings in force (that file with the launch flags over it, or the FSDP_* variables) and where
    --push_to_hub uploads (the Trainer's own push_to_hub is false in "training": this script uploads; no token)."""
    if training_args.process_index != 0:
        return
    config_file = launch.config_file if launch else None
    record = {
        "model": asdict(model_args),
        "data": asdict(data_args),
        "training": json.loads(training_args.to_json_string()),
        "accelerate_config_file": str(config_file) if config_file else None,
        "accelerate_config": read_text(config_file, "accelerate config", YAML_LIMIT)
        if config_file and config_file.is_file()
        else None,
        "accelerate_settings": launch.config if launch else None,
        "accelerate_settings_from": launch.describe() if launch else None,
        "world_size": training_args.world_size,
        "push_to_hub": {"repo_id": push.repo_id, "private": push.private, "revision": push.revision} if push else None,
    }
    path = Path(training_args.output_dir) / ARGS_NAME
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
