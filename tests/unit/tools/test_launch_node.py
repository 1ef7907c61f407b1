"""tools/slurm/launch_node.sh: a node rank outside the job (SLURM_NODEID not below SLURM_NNODES, or either not a
number) is one line and exit 2 before anything launches, not a launch that waits for nodes that never come."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO


@pytest.mark.parametrize("nodes, node_id", [("2", "2"), ("2", "7"), ("2", "-1"), ("two", "0"), ("0", "0")])
def test_node_rank_outside_the_job_is_refused_not_a_hang(nodes, node_id):
    env = {
        **os.environ,
        "SLURM_NNODES": nodes,
        "SLURM_NODEID": node_id,
        "PATH": f"{REPO / 'tests/helpers/fake_slurm'}:{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "tools/slurm/launch_node.sh"), "accelerate_configs/zero3.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("launch_node.sh: error: SLURM_NODEID="), proc.stderr
