"""What the launcher set up for this process, seen from inside it, and what we tell the launcher back.

Every launch path ends in the same environment variables (accelerate launch turns its config file plus its
command-line flags into ACCELERATE_USE_FSDP and FSDP_*), but the variables lose what a user needs to fix a
mistake: which file, which key, which flag. So the settings in force are rebuilt from where they came from:

- ``accelerate launch`` (found among this process's parents, Linux /proc): its own argument parser reads its
  command line; the config is ``--config_file`` or, without one, accelerate's default config; flags given on the
  command line override the file's keys, as accelerate does (``nondefault`` in its parser).
- any other launcher (torchrun, srun, mpirun) with ``ACCELERATE_USE_FSDP=true``: the FSDP_* variables.

The result is checked with tools/check_config.py's rules, each problem named by file and key, launch flag or
variable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError, UnreadableFile

# Problem.file for a setting that came from a launch flag
LAUNCH_FLAGS = "accelerate launch"
# ... and for one that came from an FSDP_* variable
ENVIRONMENT = "environment"
# ... and for one of this run's own settings
RUN_ARGUMENTS = "train_fsdp.py's recipe or flags"
# accelerate's launcher writes FSDP_<KEY> for fsdp_config's fsdp_<key>, except this one (accelerate/utils/launch.py)
ENV_NAMES = {"FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap"}
# launch flags that set distributed_type rather than a key of the same name
TYPE_FLAGS = {
    "use_fsdp": "FSDP",
    "multi_gpu": "MULTI_GPU",
    "cpu": "MULTI_CPU",
    "use_deepspeed": "DEEPSPEED",
    "use_megatron_lm": "MEGATRON_LM",
    "tpu": "XLA",
}
# accelerate launch's groups of flags that only their own launchers read (group title -> the launcher, and the
# distributed type it launches): under FSDP or DDP each does nothing
OTHER_LAUNCHERS = {
    "DeepSpeed Arguments": ("DeepSpeed", "DEEPSPEED"),
    "Megatron-LM Arguments": ("Megatron-LM", "MEGATRON_LM"),
    "TPU": ("TPU", "XLA"),
}
# ... and where this run has its own setting for what the flag asks
OWN_SETTING = {"gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm"}


@dataclass
class LaunchSettings:
    """The accelerate settings in force, as a config mapping (what an accelerate config YAML would hold)."""

    config: dict
    # the file they started from, if any
    config_file: Path | None = None
    # checker key -> the flag or variable that set it
    origin: dict[str, str] = field(default_factory=dict)
    # what origin's names are
    where: str = LAUNCH_FLAGS
    # the file was named on the command line (--config_file), not accelerate's default config
    named: bool = False
    # flag given -> the launcher that alone reads it
    unread: dict[str, str] = field(default_factory=dict)

    @property
    def ddp(self) -> bool:
        """DDP asked for by name: a config file given with --config_file that says MULTI_GPU or MULTI_CPU and has no
        fsdp_config (accelerate_configs/ddp.yaml), or --multi_gpu. accelerate's default config, written by `accelerate
        config default` as MULTI_GPU on any multi-GPU machine, is not a request for DDP."""
        from fsdp_recipes.config.accelerate_config import DDP_TYPES

        named = self.named or self.origin.get("distributed_type") in ("--multi_gpu", "--cpu")
        return named and self.config.get("distributed_type") in DDP_TYPES and not self.config.get("fsdp_config")

    def describe(self) -> str:
        parts = [str(self.config_file)] if self.config_file else []
        if self.origin:
            parts.append(f"{self.where} ({', '.join(sorted(set(self.origin.values())))})")
        return " + ".join(parts) or self.where

    def attribute(self, problems: list) -> list:
        """A problem with a key that a flag or variable set names that flag or variable, not the file."""
        for problem in problems:
            if problem.key in self.origin:
                problem.file, problem.key = self.where, self.origin[problem.key]
        return problems


def accelerate_default_config() -> Path:
    """The file `accelerate launch` reads without --config_file (accelerate/commands/config/config_args.py), from
    the environment now rather than at import time: HF_HOME may have been set after accelerate was imported."""
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


# the spellings of `accelerate launch`: the command, its module behind the CLI (which then takes "launch"), and
# the launch command's own entry points
CLI = ("accelerate", "accelerate.commands.accelerate_cli")
LAUNCH = ("accelerate-launch", "accelerate.commands.launch")


def launch_arguments(cmdline: list[str]) -> list[str] | None:
    """The arguments after `launch` when ``cmdline`` is an accelerate launch (any spelling), else None."""
    for i, arg in enumerate(cmdline[:-1]):
        if Path(arg).name in CLI and cmdline[i + 1] == "launch":
            return cmdline[i + 2 :]
        if arg.endswith(LAUNCH):
            return cmdline[i + 1 :]
    return None


def find_accelerate_launch() -> tuple[list[str], Path] | None:
    """The arguments after `launch` of the `accelerate launch` that started this process, and its directory."""
    pid = os.getppid()
    # accelerate runs torchrun's agent in-process: usually the direct parent
    for _ in range(3):
        try:
            args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
            cwd = Path(f"/proc/{pid}/cwd").resolve()
        except OSError:
            return None
        if (launched := launch_arguments(args)) is not None:
            return launched, cwd
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


def from_launch_args(argv: list[str], cwd: Path) -> LaunchSettings:
    """The settings `accelerate launch <argv>` puts in force: its config file overlaid with its explicit flags."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    from fsdp_recipes.config.accelerate_config import read_config_file

    parser = launch_command_parser()
    args = parser.parse_args(argv)
    given = getattr(args, "nondefault", set())
    path = Path(args.config_file) if args.config_file else (accelerate_default_config() if not args.cpu else None)
    if path is not None and not path.is_absolute():
        path = cwd / path
    config: dict = {}
    if path is not None and path.is_file():
        # or UnreadableFile
        config = read_config_file(path)
    else:
        # no file: accelerate's own defaults, set by flags
        path = None
        config = {"num_processes": int(os.environ.get("WORLD_SIZE", "1")), "num_machines": 1}
    settings = LaunchSettings(config, path, named=bool(args.config_file) and path is not None)
    top = set(ClusterConfig.__dataclass_fields__)
    unread: dict[str, tuple[str, str]] = {}
    other = {
        action.dest: OTHER_LAUNCHERS[group.title]
        for group in parser._action_groups
        if group.title in OTHER_LAUNCHERS
        for action in group._group_actions
    }
    for dest in sorted(given):
        flag, value = f"--{dest}", getattr(args, dest)
        # before the config's keys: downcast_bf16 and the tpu_* keys are TPU's alone
        if dest in other:
            unread[flag] = other[dest]
            continue
        if dest in TYPE_FLAGS and value:
            config["distributed_type"], key = TYPE_FLAGS[dest], "distributed_type"
        elif dest.startswith("fsdp_"):
            config.setdefault("fsdp_config", {})[dest] = value
            key = f"fsdp_config.{dest}"
        elif dest.startswith("parallelism_config_"):
            config.setdefault("parallelism_config", {})[dest] = value
            key = f"parallelism_config.{dest}"
        elif dest.startswith("dynamo_"):
            config.setdefault("dynamo_config", {})[dest] = value
            key = f"dynamo_config.{dest}"
        elif dest in top:
            config[dest], key = value, dest
        else:
            # launcher-only flags (--main_process_port's peers, --debug, ...)
            continue
        settings.origin[key] = flag
    # a launch of that launcher reads them (--use_deepspeed, --use_megatron_lm, --tpu, or its config file)
    launched = config.get("distributed_type")
    settings.unread = {flag: name for flag, (name, kind) in unread.items() if kind != launched}
    if path is None and config.get("distributed_type") == "FSDP":
        # missing: say the flag to add
        settings.origin.setdefault("fsdp_config.fsdp_version", "--fsdp_version")
    return settings


def from_environment(env=None) -> LaunchSettings | None:
    """The settings of a launch that set ACCELERATE_USE_FSDP itself (torchrun, srun): its FSDP_* variables (``env``:
    this process's environment when None, read at the call: a default of os.environ would keep the object bound at
    import, which a replaced os.environ leaves behind)."""
    # here, not at the top: it imports torch
    from fsdp_recipes.compat.cpu_fsdp import fsdp_requested

    env = os.environ if env is None else env
    if not fsdp_requested(env) or "ACCELERATE_DYNAMO_BACKEND" in env:
        # the second: set by accelerate launch, whose variables carry defaults for every key
        return None
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    config = {
        "distributed_type": "FSDP",
        "num_processes": world,
        "num_machines": max(1, world // max(1, local)),
        "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no"),
        "fsdp_config": {},
    }
    settings = LaunchSettings(config, None, where=ENVIRONMENT)
    for name, value in env.items():
        if name.startswith("FSDP_"):
            key = ENV_NAMES.get(name, "fsdp_" + name.removeprefix("FSDP_").lower())
            config["fsdp_config"][key] = int(value) if key == "fsdp_min_num_params" and value.isdigit() else value
            settings.origin[f"fsdp_config.{key}"] = name
    settings.origin.setdefault("fsdp_config.fsdp_version", "FSDP_VERSION")
    if "ACCELERATE_MIXED_PRECISION" in env:
        settings.origin["mixed_precision"] = "ACCELERATE_MIXED_PRECISION"
    return settings


def launch_settings() -> LaunchSettings | None:
    """The accelerate settings of this launch, or None where accelerate is not asked for FSDP or anything else."""
    if (launch := find_accelerate_launch()) is not None:
        try:
            return from_launch_args(*launch)
        # accelerate's parser refused its own command line: the launcher would have too
        except SystemExit:
            return None
        # its config file: the error train_fsdp.py reports in one line
        except UnreadableFile as err:
            raise RecipeError(str(err)) from None
    return from_environment()


def check(settings: LaunchSettings, run_settings: dict, model: str | None) -> list:
    """tools/check_config.py's rules on the settings in force, each problem named where the setting came from."""
    from fsdp_recipes.config.accelerate_config import check_settings
    from fsdp_recipes.config.problems import Problem

    # keys not from a file were named by accelerate itself (its flags, its variables): only a file's can be unknown
    problems = check_settings(
        settings.config,
        str(settings.config_file or settings.where),
        recipe=run_settings,
        recipe_file=RUN_ARGUMENTS,
        model=model,
        check_keys=settings.config_file is not None,
    )
    for flag, launcher in sorted(settings.unread.items()):
        own = OWN_SETTING.get(flag.removeprefix("--"))
        problems.append(
            Problem(
                "error",
                LAUNCH_FLAGS,
                flag,
                f"is a {launcher} flag: accelerate reads it only when it launches {launcher}, so this launch would "
                "train without it",
                f"give train_fsdp.py --{own} after the script" if own else "drop it",
            )
        )
    return settings.attribute(problems)


# what the rules compare (trust_remote_code: the warning naming the code it runs)
RUN_SETTINGS = (
    "torch_compile",
    "torch_compile_backend",
    "torch_compile_mode",
    "gradient_checkpointing",
    "activation_checkpointing",
    "save_only_model",
    "fp16",
    "bf16",
    "dtype",
    "load_in_4bit",
    "bnb_4bit_quant_storage",
    "bnb_4bit_compute_dtype",
    "zero1",
    "cpu_bf16",
    "optim",
    "trust_remote_code",
)


def check_launch(raw) -> LaunchSettings | None:
    """The launcher's accelerate settings (config file, its default, launch flags or FSDP_* variables), checked
    with this run's settings (``raw``: the parsed flags and recipe) by tools/check_config.py's rules. Warnings are
    printed once; errors stop every rank. Returns the settings (None: not an accelerate FSDP or DDP launch)."""
    from fsdp_recipes.config.model_source import missing_local_path
    from fsdp_recipes.config.problems import errors
    from fsdp_recipes.config.recipe_checks import SAVE_ONLY_MODEL

    # under every launch, with or without FSDP or a config
    if str(getattr(raw, "save_only_model", None)).lower() == "true":
        raise RecipeError(f"save_only_model {SAVE_ONLY_MODEL[0]}: {SAVE_ONLY_MODEL[1]}")
    launch = launch_settings()
    if launch is None:
        # nothing to check (a launch without FSDP is refused by parse_args, by name)
        return None
    fsdp_type = launch.config.get("distributed_type") == "FSDP"
    if not launch.ddp and (not (fsdp_type or "fsdp_config" in launch.config) or (raw.allow_no_fsdp and not fsdp_type)):
        # neither FSDP nor a DDP config (refused by parse_args, by name), or no FSDP on purpose
        return launch
    model_name = raw.model_name_or_path or raw.config_name
    if model_name and missing_local_path(str(model_name)):
        # the run's own check of its arguments names the missing folder, in one line, just after
        model_name = None
    problems = check(launch, {k: getattr(raw, k, None) for k in RUN_SETTINGS}, model_name)
    for problem in problems:
        if problem.level == "warning":
            say(str(problem))
    if errors(problems):
        raise RecipeError(
            f"{launch.describe()} has {len(errors(problems))} error(s): " + " | ".join(str(p) for p in errors(problems))
        )
    return launch


def no_fsdp_problem() -> str:
    """Why this launch would train without FSDP, and the command that trains with it."""
    fix = (
        "launch with an FSDP config: `accelerate launch --config_file accelerate_configs/zero3.yaml train_fsdp.py ...` "
        "(or torchrun with --fsdp true --fsdp_config accelerate_configs/torchrun/zero3.json); for DDP or ZeRO-1, "
        "--config_file accelerate_configs/ddp.yaml; pass --allow_no_fsdp true to train without FSDP on purpose"
    )
    if any(k.startswith("ACCELERATE_") for k in os.environ):
        why = "accelerate launch without an FSDP config (its default config, or distributed_type other than FSDP)"
    elif "WORLD_SIZE" in os.environ:
        why = "a launch without --fsdp (torchrun or another launcher)"
    else:
        why = "no launcher: `python train_fsdp.py` runs one process"
    return f"this launch would train without FSDP ({why}): {fix}"


def unused_accelerators_warning(devices: int | None = None) -> str | None:
    """The shipped configs say num_processes: 2 so they run anywhere; on an 8-GPU node that quietly uses 2."""
    if devices is None:
        import torch

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if devices > local:
        return (
            f"warning: this node has {devices} GPUs and this launch uses {local} of them: pass --num_processes "
            f"{devices} to accelerate launch (x the number of nodes), or --nproc_per_node {devices} to torchrun"
        )
    return None


def one_process_note(settings: LaunchSettings | None, world: int) -> str | None:
    """The start-up line of FSDP2 FULL_SHARD on one process: it has nothing to shard over, yet gathers each layer's
    parameters before its forward and again before its backward, every step. On one H200 zero3.yaml ran at 15.4-23.5%
    MFU across visits where zero2.yaml (parameters kept gathered from forward to backward) ran 28.5% and ddp.yaml
    28.9% (bench/results/README.md). None elsewhere: 2+ processes; offload, which frees the GPU of the model states
    even alone; FSDP1, which torch itself switches to NO_SHARD in a group of one (and says so)."""
    from fsdp_recipes.config.strategy import strategy_of

    if settings is None or world != 1 or settings.config.get("distributed_type") != "FSDP":
        return None
    try:
        strategy = strategy_of(settings.config)
    # a value check_launch's rules name; nothing to advise on
    except (TypeError, ValueError, OverflowError):
        return None
    if strategy.fsdp_version != 2 or strategy.name != "FULL_SHARD" or strategy.offload:
        return None
    return (
        f"note: FSDP2 FULL_SHARD on 1 process ({settings.describe()}): nothing is sharded, and every layer's "
        "parameters are still gathered twice a step (one H200: 15.4-23.5% MFU against zero2.yaml's 28.5% and "
        "ddp.yaml's 28.9%); on one GPU launch with --config_file accelerate_configs/ddp.yaml, or "
        "accelerate_configs/zero2.yaml (keeps the parameters gathered, 2 bytes a parameter more), where they fit "
        "(tools/estimate_memory.py MODEL --nproc-per-node 1 --gpu-memory 80GiB); 2 or more processes shard as before"
    )


def tell_launcher(message: str) -> None:
    """Hand our one-line message to torch elastic (accelerate launch, torchrun) as this worker's error record.

    The launcher then prints it as the root cause at the end of its failure report, in place of "To enable
    traceback see: ...": the user's first and last line are ours. The file is in the format torch's own @record
    writes (torch/distributed/elastic/multiprocessing/errors/error_handler.py); without a launcher, nothing.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        # the launcher prints py_callstack
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    # the launcher's report is then its default one; ours is already on stderr
    except OSError as err:
        print(f"train_fsdp.py: could not write the launcher's error file {path}: {err}", file=sys.stderr)
