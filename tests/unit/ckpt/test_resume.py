"""One resume decision per launch: global rank 0 reads the checkpoints (each rank's RNG state once) after
the process group starts, every rank takes its decision, and ranks that see other checkpoints than rank 0 stop
alike with one line naming who saw what, before anything is moved."""

from __future__ import annotations

import json
import re
import socket
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import plain_checkpoint

from fsdp_recipes.ckpt.resume import (
    MAX_STALLED_REQUEUES,
    REQUEUE_RECORD,
    Sight,
    check_requeue,
    decide,
    disagreement,
    sight,
)
from fsdp_recipes.config.plan import Plan
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train import preflight

CONFIG = "accelerate_configs/zero3.yaml"
# the synthetic checkpoint's ranks
WORLD = 8
HOST = socket.gethostname()


@pytest.fixture
def opened(monkeypatch):
    """The files under a folder this process opens (Python's audit hook sees every open), while ``watch`` is set."""
    seen: list[str] = []
    watch: list[Path] = []

    def hook(event, args):
        if event == "open" and watch and isinstance(args[0], (str, Path)) and str(args[0]).startswith(str(watch[0])):
            seen.append(Path(args[0]).name)

    # cannot be removed: inert once ``watch`` is emptied
    sys.addaudithook(hook)
    yield seen, watch
    watch.clear()


def test_rank_0_reads_each_rank_file_once_and_the_others_read_none(tmp_path, monkeypatch, opened):
    """O(world) reads per resume: rank 0's decision opens each rank's RNG file once (and unpickles it once); a rank
    other than 0 takes the broadcast decision and opens no file of the checkpoint at all."""
    import torch

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    run = tmp_path / "run"
    ckpt = plain_checkpoint(run, 4, WORLD)
    # incomplete: skipped
    (newer := plain_checkpoint(run, 8, WORLD)).joinpath("trainer_state.json").unlink()
    seen, watch = opened
    loads = Counter()
    torch_load = torch.load
    monkeypatch.setattr(
        torch, "load", lambda f, *a, **k: loads.update([getattr(f, "name", f)]) or torch_load(f, *a, **k)
    )

    plan = Plan(raw=type("Raw", (), {"resume_from_checkpoint": "true", "output_dir": str(run)})())
    watch.append(run)
    # one process: global rank 0
    preflight.decide_resume(plan)
    watch.clear()
    rng = Counter(name for name in seen if name.startswith("rng_state_"))
    # once in each of the two folders weighed
    assert rng == {f"rng_state_{r}.pth": 2 for r in range(WORLD)}, rng
    # every file unpickled once
    assert sorted(Counter(str(p) for p in loads).values()) == [1] * len(loads)
    assert plan.resume == str(ckpt) and [s.path for s in plan.set_aside] == [newer]

    # what rank 0 broadcasts
    decision = decide("true", str(run))
    monkeypatch.setattr(preflight, "_rank", lambda: 3)
    monkeypatch.setattr(preflight, "_broadcast", lambda value: decision)
    monkeypatch.setattr(preflight, "_all_gather", lambda value: [value] * WORLD)
    seen.clear()
    loads.clear()
    other = Plan(raw=plan.raw)
    watch.append(run)
    preflight.decide_resume(other)
    watch.clear()
    # folder names only
    assert seen == [] and not loads
    assert (other.resume, other.set_aside) == (plan.resume, plan.set_aside)


def test_disagreements_are_one_line_naming_who_saw_what(tmp_path):
    out = str(tmp_path / "run")
    chosen = f"{out}/checkpoint-12"
    same = [Sight("a", "checkpoint-12", True), Sight("b", "checkpoint-12", True)]
    assert disagreement("true", out, chosen, same) is None
    stale = [
        Sight("a", "checkpoint-12", True),
        Sight("b", "checkpoint-12", True),
        Sight("c", "checkpoint-6", False),
        Sight("d", None, False),
    ]
    line = disagreement("true", out, chosen, stale)
    assert line.startswith(
        f"--resume_from_checkpoint true: in output_dir {out!r} rank 0 (a) sees checkpoint-12 as the "
        "newest checkpoint, rank 2 (c) sees checkpoint-6 (and 1 more rank(s)): "
    )
    assert line.endswith("then run the same command again; nothing was moved or deleted") and "\n" not in line
    # the newest agrees (an incomplete one), the chosen older one is missing on a rank
    unseen = [Sight("a", "checkpoint-18", True), Sight("b", "checkpoint-18", False)]
    assert "rank 0 (a) chose checkpoint-12 in output_dir" in disagreement("true", out, chosen, unseen)
    assert "which rank 0 (a) sees and rank 1 (b) does not" in disagreement("true", out, chosen, unseen)
    # a path: a folder for one rank and not another, whichever rank 0 is
    given = [Sight("a", None, False), Sight("b", None, True)]
    assert f"--resume_from_checkpoint {chosen!r} is a folder for rank 1 (b) and not for rank 0 (a)" in disagreement(
        chosen, out, chosen, given
    )
    assert disagreement(chosen, out, chosen, [Sight("a", None, True)] * 3) is None


def test_rank_0s_refusal_reaches_every_rank_and_a_disagreement_comes_first(tmp_path, monkeypatch):
    """A rank that sees what rank 0 does stops with rank 0's line; one that sees otherwise stops every rank with the
    disagreement instead (rank 0's verdict may rest on a stale view)."""
    run = tmp_path / "run"
    # not a checkpoint: no complete one
    (run / "checkpoint-6").mkdir(parents=True)
    raw = type("Raw", (), {"resume_from_checkpoint": "true", "output_dir": str(run)})()
    decision = decide("true", str(run))
    assert decision.error.startswith("--resume_from_checkpoint true: no complete checkpoint-N folder")
    monkeypatch.setattr(preflight, "_rank", lambda: 1)
    monkeypatch.setattr(preflight, "_broadcast", lambda value: decision)
    monkeypatch.setattr(preflight, "_all_gather", lambda value: [sight("true", str(run), None), value])
    with pytest.raises(RecipeError, match="^--resume_from_checkpoint true: no complete checkpoint-N folder"):
        preflight.decide_resume(Plan(raw=raw))
    monkeypatch.setattr(
        preflight, "_all_gather", lambda value: [sight("true", str(run), None), Sight(HOST, "checkpoint-9", False)]
    )
    with pytest.raises(
        RecipeError, match="rank 0 .* sees checkpoint-6 as the newest checkpoint, rank 1 .* sees checkpoint-9"
    ):
        preflight.decide_resume(Plan(raw=raw))


def _notes(p: Path):
    p.mkdir(parents=True)
    (p / "notes.txt").write_text("mine")


def _saved_model(p: Path):
    p.mkdir(parents=True)
    (p / "config.json").write_text("{}")
    (p / "model.safetensors").write_text("x")


def _nested(p: Path):
    p.mkdir(parents=True)
    (p / "data").mkdir()
    (p / "data" / "a.txt").write_text("mine")


def _link(p: Path):
    target = p.parent.parent / "elsewhere"
    _notes(target)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.symlink_to(target, target_is_directory=True)


@pytest.mark.parametrize("make", [_notes, _saved_model, _nested, _link], ids=lambda f: f.__name__.strip("_"))
def test_a_folder_only_named_like_a_checkpoint_is_not_moved_aside(tmp_path, make):
    """`--resume_from_checkpoint true` never renames a user's folder called checkpoint-9 (or a link) to
    incomplete-checkpoint-9 as if a save had died in it. Only a checkpoint's shape (or an empty folder) is set aside;
    anything else stops the resume, naming it, before anything moves."""
    from fsdp_recipes.ckpt.resume import resolve_resume

    out = tmp_path / "run"
    make(out / "checkpoint-9")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(
        RecipeError, match=r"checkpoint-9 is named like a checkpoint but is not one \(it (holds|is a link)"
    ):
        resolve_resume("true", str(out))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_an_empty_checkpoint_folder_is_still_a_dead_save(tmp_path):
    from fsdp_recipes.ckpt.resume import resolve_resume

    # a save killed before its first file
    (tmp_path / "run" / "checkpoint-9").mkdir(parents=True)
    with pytest.raises(RecipeError, match=r"no complete checkpoint-N folder .* \(incomplete: checkpoint-9\)"):
        resolve_resume("true", str(tmp_path / "run"))


def test_a_save_killed_while_torch_renames_its_metadata_is_still_a_dead_save(tmp_path):
    """torch's DCP writer writes .metadata.tmp, then renames it: a checkpoint killed between is an incomplete
    checkpoint of ours, set aside, not refused as 'named like a checkpoint but not one'."""
    from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE
    from fsdp_recipes.ckpt.resume import resolve_resume
    from fsdp_recipes.removal import make_folder

    ckpt = make_folder(tmp_path / "run" / "checkpoint-9", CHECKPOINT_PURPOSE)
    for shards, tmp in (("pytorch_model_fsdp_0", ".metadata.tmp"), ("optimizer_0", "__1.metadata.tmp")):
        (ckpt / shards).mkdir()
        (ckpt / shards / "__0_0.distcp").write_bytes(b"x" * 64)
        (ckpt / shards / tmp).write_bytes(b"y")
    with pytest.raises(RecipeError, match=r"no complete checkpoint-N folder .* \(incomplete: checkpoint-9\)"):
        resolve_resume("true", str(tmp_path / "run"))


def _run_with_checkpoint(run: Path) -> None:
    ckpt = run / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")


@pytest.mark.parametrize("missing", ["{other}/checkpoint-4", "{other}/not-there", ""])
def test_an_explicit_resume_path_that_is_not_a_folder_is_named_first(tmp_path, missing):
    """Before anything else judges output_dir: a typo in the path is named as a typo, not as another run's folder."""
    from fsdp_recipes.config.parse import parse_args

    _run_with_checkpoint(tmp_path / "a")
    path = missing.format(other=tmp_path / "aa")
    with pytest.raises(RecipeError, match=f"--resume_from_checkpoint {re.escape(repr(path))} is not a folder"):
        parse_args(["--allow_no_fsdp", "true", "--output_dir", str(tmp_path / "a"), "--resume_from_checkpoint", path])


def test_any_failure_of_rank_0s_resume_decision_becomes_its_error(tmp_path, monkeypatch):
    """Rank 0 alone decides: an exception there must travel to every rank as the decision's error, not leave the
    others waiting in the broadcast."""
    from fsdp_recipes.ckpt.resume import decide

    (tmp_path / "requeue_progress.json").write_text('{"step": 1e999, "stalled": 0}')
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    decision = decide(None, str(tmp_path))
    assert decision.path is None and decision.error and "the resume could not be decided" in decision.error


def test_requeue_loop_without_progress_stops(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    ckpt = str(out / "checkpoint-9")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    # not a requeued job: nothing recorded
    assert check_requeue(str(out), ckpt) is None
    # the first requeue, then attempts that start where it did
    for restart in range(1, MAX_STALLED_REQUEUES + 1):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        record = check_requeue(str(out), ckpt)
        assert record == {"restart": restart, "step": 9, "stalled": restart - 1}
        # what preflight writes on rank 0
        (out / REQUEUE_RECORD).write_text(json.dumps(record))
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(MAX_STALLED_REQUEUES + 1))
    with pytest.raises(RecipeError, match=f"requeued {MAX_STALLED_REQUEUES} times in a row without a new checkpoint"):
        check_requeue(str(out), ckpt)
    # a newer checkpoint: progress
    assert check_requeue(str(out), str(out / "checkpoint-12"))["stalled"] == 0
