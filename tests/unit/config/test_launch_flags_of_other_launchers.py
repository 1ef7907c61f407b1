"""A flag of `accelerate launch` that only another launcher reads (DeepSpeed's, Megatron-LM's, TPU's) is one error
naming the flag, and this run's own setting where it has one, since the launch would train without it; a flag that
acts on the launch is never refused as unread. accelerate is the oracle: what a flag changes in the environment it
gives an FSDP launch's ranks (prepare_multi_gpu_env, after its own validation of the command line)."""

from __future__ import annotations

import argparse

import pytest
from accelerate.commands import launch as accelerate_launch
from conftest import REPO
from helpers.accelerate_oracle import ranks_environment

from fsdp_recipes.config.launcher import OTHER_LAUNCHERS, OWN_SETTING, check, from_launch_args
from fsdp_recipes.config.problems import errors

CONFIG = ("--config_file", "accelerate_configs/zero3.yaml")
PARSER = accelerate_launch.launch_command_parser()
# flags that pick another launch (another distributed type or launcher), not a setting of this one
OTHER_LAUNCH = {"cpu", "multi_gpu", "tpu", "use_deepspeed", "use_megatron_lm", "module", "no_python"}


def sample(action: argparse.Action) -> tuple[str, ...]:
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return (flag,)
    if action.choices:
        return (flag, str(list(action.choices)[-1]))
    return (flag, "1")


FLAGS = {
    action.dest: sample(action)
    for group in PARSER._action_groups
    for action in group._group_actions
    if action.option_strings and action.dest not in {"help", "config_file", *OTHER_LAUNCH}
}
OTHERS = {
    action.dest
    for group in PARSER._action_groups
    if group.title in OTHER_LAUNCHERS
    for action in group._group_actions
    if action.option_strings
}


def unread_errors(flags: tuple[str, ...]) -> list:
    settings = from_launch_args([*CONFIG, *flags, "train_fsdp.py"], REPO)
    return [p for p in errors(check(settings, {}, None)) if "accelerate reads it only when it launches" in p.message]


@pytest.mark.parametrize("dest", sorted(FLAGS))
def test_a_flag_is_refused_as_unread_only_where_accelerate_does_not_read_it(dest):
    flags = FLAGS[dest]
    environment = ranks_environment((*CONFIG, *flags))
    if environment is None:
        pytest.skip(f"accelerate refuses {' '.join(flags)} itself")
    refused = unread_errors(flags)
    if refused:
        # here: the environment it copies names the test running
        base = ranks_environment(CONFIG)
        assert environment == base, f"{flags} acts on the launch: {set(environment.items()) ^ set(base.items())}"
    if dest in OTHERS:
        if dest not in PARSER.parse_args([*CONFIG, *flags, "train_fsdp.py"]).nondefault:
            pytest.skip(f"accelerate does not record {flags[0]} as given (TPU pods' --vm and --env)")
        [problem] = refused
        assert problem.key == f"--{dest}" and problem.file == "accelerate launch", problem
        own = OWN_SETTING.get(dest)
        assert problem.fix == (f"give train_fsdp.py --{own} after the script" if own else "drop it"), problem


def test_the_other_launchers_groups_are_accelerates():
    """The groups read from accelerate's parser are there: a renamed group would refuse nothing."""
    titles = {group.title for group in PARSER._action_groups}
    assert set(OTHER_LAUNCHERS) <= titles
    assert {"gradient_clipping", "gradient_accumulation_steps", "zero_stage"} <= OTHERS


@pytest.mark.parametrize(
    "flags",
    [
        ("--use_deepspeed", "--zero_stage", "3", "--gradient_clipping", "1.0"),
        ("--use_megatron_lm", "--megatron_lm_tp_degree", "2"),
        ("--tpu", "--downcast_bf16"),
    ],
    ids=["deepspeed", "megatron-lm", "tpu"],
)
def test_a_launch_of_that_launcher_is_not_told_it_ignores_its_own_flags(flags):
    """--use_deepspeed (or --use_megatron_lm, --tpu) makes it that launcher's launch: its flags are read, and the
    launch is refused for training without FSDP instead, by parse_args."""
    assert unread_errors(flags) == []
    settings = from_launch_args([*CONFIG, *flags, "train_fsdp.py"], REPO)
    assert settings.config["distributed_type"] != "FSDP" and settings.unread == {}
