"""Checkpoint validation and resume selection, on damaged copies of real checkpoints written by train_fsdp.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli

from fsdp_recipes.ckpt.resume import check_output_dir, resolve_resume
from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.config.plan import Plan
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train import preflight

FULL = ("--fsdp_state_dict_type", "FULL_STATE_DICT")


@pytest.fixture(autouse=True)
def launched_like_accelerate(monkeypatch):
    """Resume resolution reads the launcher's environment: an FSDP launch of 2 processes, seen from rank 0."""
    for key, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """A private copy of a real 2-rank FSDP2 run (checkpoint-6 and checkpoint-12), for breaking."""
    copy = tmp_path / "run"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir, copy)
    return copy


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# how to damage checkpoint-12, and the problem the validator must name
DAMAGE = {
    "truncated model shard": (
        lambda c: truncate(c / "pytorch_model_fsdp_0" / "__1_0.distcp"),
        "truncated pytorch_model_fsdp_0/__1_0.distcp",
    ),
    "missing model metadata": (
        lambda c: (c / "pytorch_model_fsdp_0" / ".metadata").unlink(),
        "missing pytorch_model_fsdp_0/.metadata",
    ),
    "missing optimizer shard": (
        lambda c: (c / "optimizer_0" / "__0_0.distcp").unlink(),
        "missing optimizer_0/__0_0.distcp",
    ),
    "missing optimizer metadata": (
        lambda c: (c / "optimizer_0" / ".metadata").unlink(),
        "missing optimizer_0/.metadata",
    ),
    "truncated optimizer metadata": (
        lambda c: truncate(c / "optimizer_0" / ".metadata"),
        "unreadable optimizer_0/.metadata",
    ),
    "missing trainer state": (lambda c: (c / "trainer_state.json").unlink(), "missing trainer_state.json"),
    "missing rank-1 RNG state": (lambda c: (c / "rng_state_1.pth").unlink(), "missing rng_state_1.pth"),
    "truncated scheduler": (lambda c: truncate(c / "scheduler.pt"), "truncated or unreadable scheduler.pt"),
    "no optimizer at all": (lambda c: shutil.rmtree(c / "optimizer_0"), "missing optimizer_0/ (optimizer shards)"),
}


def test_complete_checkpoint_reports_what_it_holds(run_dir):
    status = checkpoint_status(run_dir / "checkpoint-12")
    assert status.resumable, status.problems
    assert (status.step, status.fsdp_version, status.sharding_strategy, status.world_size, status.state_dict_type) == (
        12,
        2,
        "FULL_SHARD",
        2,
        "SHARDED_STATE_DICT",
    )
    # world size is also found without our fsdp_report.json (checkpoints other scripts wrote): from the shards
    (run_dir / "checkpoint-12" / "fsdp_report.json").unlink()
    status = checkpoint_status(run_dir / "checkpoint-12")
    assert status.resumable and status.world_size == 2 and status.fsdp_version is None


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_checkpoint_is_named_skipped_and_set_aside(run_dir, damage, capsys):
    do, problem = DAMAGE[damage]
    do(run_dir / "checkpoint-12")
    status = checkpoint_status(run_dir / "checkpoint-12")
    assert not status.resumable and any(problem in p for p in status.problems), status.problems

    # decides; the preflight moves
    resume = resolve_resume("true", str(run_dir))
    assert resume.path == str(run_dir / "checkpoint-6") and (run_dir / "checkpoint-12").is_dir()
    preflight.carry_out(Plan(set_aside=resume.set_aside))
    err = capsys.readouterr().err
    assert (
        "skipping checkpoint-12" in err and problem in err and "moved checkpoint-12 to incomplete-checkpoint-12" in err
    )
    assert not (run_dir / "checkpoint-12").exists() and (run_dir / "incomplete-checkpoint-12").is_dir()


def test_explicit_incomplete_checkpoint_is_refused_with_the_alternative(run_dir):
    (run_dir / "checkpoint-12" / "rng_state_0.pth").unlink()
    with pytest.raises(RecipeError, match=f"resume from {run_dir / 'checkpoint-6'} \\(the newest complete one\\)"):
        resolve_resume(str(run_dir / "checkpoint-12"), str(run_dir))
    # a refused resume moves nothing
    assert (run_dir / "checkpoint-12").is_dir()
    # an earlier checkpoint of the run starts a new branch: the later one is set aside, never rewritten in place
    resume = resolve_resume(str(run_dir / "checkpoint-6"), str(run_dir))
    assert resume.path == str(run_dir / "checkpoint-6") and (run_dir / "checkpoint-12").is_dir()
    preflight.carry_out(Plan(set_aside=resume.set_aside))
    assert not (run_dir / "checkpoint-12").exists() and (run_dir / "replaced-checkpoint-12").is_dir()


def test_no_complete_checkpoint_is_a_clear_error(run_dir):
    for step in (6, 12):
        (run_dir / f"checkpoint-{step}" / "trainer_state.json").unlink()
    with pytest.raises(
        RecipeError, match="no complete checkpoint-N folder .* \\(incomplete: checkpoint-12, checkpoint-6\\)"
    ):
        resolve_resume("true", str(run_dir))


def test_sharded_checkpoint_outside_fsdp_is_refused(run_dir, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(RecipeError, match="holds FSDP shards: resume it under FSDP"):
        resolve_resume("true", str(run_dir))


def test_output_dir_of_another_run(run_dir):
    with pytest.raises(RecipeError, match="already holds another run's checkpoints \\(checkpoint-12, checkpoint-6\\)"):
        check_output_dir(str(run_dir), resuming=False, overwrite=False)
    # resuming it is fine
    check_output_dir(str(run_dir), resuming=True, overwrite=False)
    # decides; the preflight deletes
    delete = check_output_dir(str(run_dir), resuming=False, overwrite=True)
    assert sorted(p.name for p in delete) == ["checkpoint-12", "checkpoint-6"] and (run_dir / "checkpoint-12").is_dir()
    preflight.carry_out(Plan(delete=delete))
    assert not list(run_dir.glob("checkpoint-*")) and (run_dir / "model" / "model.safetensors").is_file()


def test_full_state_dict_checkpoint(trained, tmp_path):
    ckpt = tmp_path / "checkpoint-12"
    shutil.copytree(trained("accelerate_configs/zero3.yaml", launch_args=FULL).output_dir / "checkpoint-12", ckpt)
    status = checkpoint_status(ckpt)
    assert status.resumable and (status.state_dict_type, status.world_size, status.step) == ("FULL_STATE_DICT", 2, 12)
    truncate(ckpt / "optimizer.bin")
    assert checkpoint_status(ckpt).problems == ["truncated or unreadable optimizer.bin"]


def test_cli_one_checkpoint_a_run_and_json(run_dir, capsys):
    """tools/check_checkpoint.py's main(argv), in this process: its lines, exit codes and --json report."""
    (run_dir / "checkpoint-12" / "optimizer_0" / ".metadata").unlink()
    assert cli("check_checkpoint", [str(run_dir / "checkpoint-12")]) == 1
    assert capsys.readouterr().out.strip() == (
        "checkpoint-12 (step 12, FSDP2, FULL_SHARD, SHARDED_STATE_DICT, 2 rank(s)): INCOMPLETE: missing "
        "optimizer_0/.metadata"
    )
    assert cli("check_checkpoint", [str(run_dir)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1] == "checkpoint-6 (step 6, FSDP2, FULL_SHARD, SHARDED_STATE_DICT, 2 rank(s)): resumable"
    assert lines[2] == "resume: --resume_from_checkpoint true uses checkpoint-6 (setting aside checkpoint-12)"
    cli("check_checkpoint", [str(run_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["resume_uses"] == str(run_dir / "checkpoint-6")
    assert [c["resumable"] for c in report["checkpoints"]] == [False, True]
    # the tool only looks
    assert (run_dir / "checkpoint-12").is_dir()
    assert cli("check_checkpoint", [str(run_dir / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("check_checkpoint.py: error: ") and "is not a folder" in err
    assert cli("check_checkpoint", ["--help"]) == 0
    assert "--json" in capsys.readouterr().out
