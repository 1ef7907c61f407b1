"""FSDP2 FULL_SHARD on one process shards nothing and costs speed: the start-up says so and names the configs to use;
every other launch, and every launch of 2+ processes, hears nothing of it."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO

from fsdp_recipes.compat import cpu_fsdp
from fsdp_recipes.config.launcher import LaunchSettings, one_process_note
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.strategy import strategy_of

CONFIGS = sorted((REPO / "accelerate_configs").rglob("*.yaml"))


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_only_fsdp2_full_shard_without_offload_on_one_process_is_told(path, world):
    config = yaml.safe_load(path.read_text())
    note = one_process_note(LaunchSettings(config, path, named=True), world)
    strategy = strategy_of(config)
    told = world == 1 and strategy.fsdp_version == 2 and strategy.name == "FULL_SHARD" and not strategy.offload
    assert (note is not None) == told
    if told:
        assert "\n" not in note and str(path) in note and "FSDP2 FULL_SHARD on 1 process (" in note
        assert "accelerate_configs/ddp.yaml" in note and "accelerate_configs/zero2.yaml" in note


@pytest.mark.parametrize(
    "fsdp, told",
    [
        # FSDP_* variables are strings
        ({"fsdp_version": "2"}, True),
        ({"fsdp_version": "2", "fsdp_reshard_after_forward": "false"}, False),
        ({"fsdp_version": "2", "fsdp_offload_params": "true"}, False),
        ({"fsdp_version": "1"}, False),
        # a bad value: check_launch's rules name it; no advice on it
        ({"fsdp_version": "two"}, False),
    ],
)
def test_a_launch_from_variables_is_told_alike(fsdp, told):
    settings = LaunchSettings({"distributed_type": "FSDP", "fsdp_config": fsdp}, None)
    assert (one_process_note(settings, 1) is not None) == told
    assert one_process_note(settings, 2) is None
    assert one_process_note(None, 1) is None


def test_the_note_is_printed_at_start_up(tmp_path, monkeypatch, capsys):
    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    # one GPU: no CPU refusal of one process
    monkeypatch.setattr(cpu_fsdp, "accelerator_present", lambda: True)
    parse_args(["--max_steps", "2", "--output_dir", str(tmp_path / "out")])
    assert "FSDP2 FULL_SHARD on 1 process (" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    parse_args(["--max_steps", "2", "--output_dir", str(tmp_path / "out")])
    assert "FULL_SHARD on 1 process" not in capsys.readouterr().err
