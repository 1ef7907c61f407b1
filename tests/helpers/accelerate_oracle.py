"""accelerate's own launcher as a test oracle: what it gives the ranks of a launch, without starting any.

    environment = ranks_environment(("--config_file", "accelerate_configs/zero3.yaml", "--zero_stage", "3"))

Used by tests/unit/config/test_launch_flags_of_other_launchers.py and test_config_file_read_as_accelerate_reads.py."""

from __future__ import annotations


def ranks_environment(launch_args: tuple[str, ...]) -> dict | None:
    """The environment `accelerate launch <launch_args> train_fsdp.py` gives an FSDP or DDP launch's ranks (its
    parser, its own validation of the command line and config file, prepare_multi_gpu_env); None where accelerate
    refuses them. It copies this process's environment: compare two results within one test."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from fsdp_recipes.compat import internals

    try:
        parsed = launch_command_parser().parse_args([*launch_args, "train_fsdp.py"])
        args, _, _ = internals.get("accelerate.commands.launch._validate_launch_command")(parsed)
        return prepare_multi_gpu_env(args)
    except (SystemExit, ValueError, TypeError, AttributeError, RuntimeError):
        return None
