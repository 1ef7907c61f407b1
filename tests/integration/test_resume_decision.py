"""One resume decision per launch, in real 2-process launches: ranks that see other checkpoints than rank 0 stop alike
in one line naming both views, nothing moved; a normal resume reads each rank's RNG file once to check and once to
use, and ends bit-identical to the run that never stopped."""

from __future__ import annotations

import shutil
import socket
from collections import Counter
from pathlib import Path

from conftest import FAULT_SCRIPT, QUICK, launch

CONFIG = "accelerate_configs/zero3.yaml"
HOST = socket.gethostname()


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_ranks_that_see_another_newest_checkpoint_stop_alike(trained, tmp_path):
    """A real 2-process launch where rank 1 sees another folder at output_dir's path (it works in another directory
    and output_dir is relative, as a node with a stale mount would): rank 0 sees checkpoint-18 (incomplete, which it
    would set aside) and checkpoint-12, rank 1 only checkpoint-6. Every rank stops with the same one line naming
    both views; nothing is moved, locked or written; rank 1 opened no checkpoint file, rank 0 each RNG file once."""
    reference = trained(CONFIG).output_dir
    node0, node1, loads = tmp_path / "node0", tmp_path / "node1", tmp_path / "loads"
    for step in (6, 12):
        shutil.copytree(reference / f"checkpoint-{step}", node0 / "run" / f"checkpoint-{step}")
    shutil.copytree(reference / "checkpoint-12", node0 / "run" / "checkpoint-18")
    (node0 / "run" / "checkpoint-18" / "trainer_state.json").unlink()
    shutil.copytree(reference / "checkpoint-6", node1 / "run" / "checkpoint-6")
    loads.mkdir()
    before = tree(tmp_path / "node0"), tree(tmp_path / "node1")

    proc = launch(
        CONFIG,
        *QUICK,
        "--output_dir",
        "run",
        "--resume_from_checkpoint",
        "true",
        cwd=node0,
        script=FAULT_SCRIPT,
        env={"FSDP_RANK_CWD": f"1:{node1}", "FSDP_COUNT_LOADS": str(loads)},
        check=False,
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert (
        f"train_fsdp.py: error: --resume_from_checkpoint true: in output_dir 'run' rank 0 ({HOST}) sees checkpoint-18 "
        f"as the newest checkpoint, rank 1 ({HOST}) sees checkpoint-6: "
    ) in errors[0], errors[0]
    assert "nothing was moved or deleted" in errors[0] and "skipping checkpoint-18" not in proc.stderr
    # no set-aside, no lock, no run_args.json
    assert (tree(node0), tree(node1)) == before

    rank0 = Counter(Path(p).relative_to(node0 / "run").as_posix() for p in (loads / "rank0.txt").read_text().split())
    assert {p: n for p, n in rank0.items() if "rng_state" in p} == {
        f"checkpoint-{step}/rng_state_{rank}.pth": 1 for step in (18, 12) for rank in (0, 1)
    }, rank0
    # rank 1 loaded nothing
    assert not (loads / "rank1.txt").exists()


def test_a_resume_loads_each_rank_rng_state_once_to_check_and_once_to_use(trained, tmp_path):
    """The normal resume through the one decision: rank 0 checks both RNG files once, then each rank loads its own
    (the Trainer): 2 x world loads, not world^2; the run ends bit-identical to the uninterrupted one."""
    import torch
    from safetensors.torch import load_file

    reference = trained(CONFIG).output_dir
    out, loads = tmp_path / "run", tmp_path / "loads"
    shutil.copytree(reference / "checkpoint-6", out / "checkpoint-6")
    loads.mkdir()
    proc = launch(
        CONFIG,
        *QUICK,
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "true",
        script=FAULT_SCRIPT,
        env={"FSDP_COUNT_LOADS": str(loads)},
    )
    assert f"resuming from {out / 'checkpoint-6'}" in proc.stdout
    rng = {
        rank: Counter(Path(p).name for p in (loads / f"rank{rank}.txt").read_text().split() if "rng_state" in p)
        for rank in (0, 1)
    }
    assert rng == {0: {"rng_state_0.pth": 2, "rng_state_1.pth": 1}, 1: {"rng_state_1.pth": 1}}, rng
    final, expected = (
        load_file(out / "model" / "model.safetensors"),
        load_file(reference / "model" / "model.safetensors"),
    )
    assert set(final) == set(expected) and all(torch.equal(final[k], expected[k]) for k in expected)
