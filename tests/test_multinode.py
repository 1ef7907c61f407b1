"""The SLURM launch logic on two fake nodes (loopback): real FSDP over 4 processes, same model as one node."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUICK, REPO, launch, read_json
from fsdp_recipes.merge import merge_checkpoint

SCRIPT = str(REPO / "tools" / "slurm" / "launch_node.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("config, shard_group", [("accelerate_configs/zero3.yaml", 4), ("accelerate_configs/hybrid_shard.yaml", 2)])
def test_two_fake_slurm_nodes_match_one_node(trained, tmp_path, config, shard_group):
    """zero3: sharded over all 4 processes of both nodes. hybrid_shard: sharded inside each node, one replica per node."""
    shared = tmp_path / "shared-output"  # both "nodes" write here, as on a shared filesystem
    env = {
        **os.environ, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]", "MAIN_PROCESS_IP": "127.0.0.1",
        "MAIN_PROCESS_PORT": str(free_port()), "GPUS_PER_NODE": "2", "OMP_NUM_THREADS": "1",
    }
    args = ["bash", SCRIPT, config, *QUICK, "--output_dir", str(shared)]
    nodes = [subprocess.Popen(args, cwd=REPO, env={**env, "SLURM_NODEID": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "node 0/2" in logs[0] and "node 1/2" in logs[1]

    report = read_json(shared / "fsdp_report.json")
    assert report["world_size"] == 4 and report["distributed_type"] == "FSDP"
    total = report["total_param_elements"]
    replicas = 4 // shard_group
    assert sum(rank["local_param_elements"] for rank in report["ranks"]) == total * replicas  # each element once per replica
    for rank in report["ranks"]:  # 1/shard_group each, give or take the 474 embedding rows split 119/119/118/118
        assert rank["wrapper"] == "FSDP2" and abs(rank["local_param_elements"] * shard_group - total) < 0.01 * total, rank
    shards = shared / "checkpoint-12" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]

    if shard_group == 4:
        single = tmp_path / "one-node"
        launch(config, *QUICK, "--output_dir", str(single), launch_args=("--num_processes", "4"))
    else:  # the session's one-machine run of the same 2 x 2 mesh
        single = trained(config).output_dir
    two_nodes, one_node = load_file(shared / "model.safetensors"), load_file(single / "model.safetensors")
    assert set(two_nodes) == set(one_node)
    for name in one_node:
        assert torch.equal(two_nodes[name], one_node[name]), name

    merged = tmp_path / "merged"  # the checkpoint both nodes wrote merges into the same model
    merge_checkpoint(shared / "checkpoint-12", merged, log=lambda *_: None)
    assert all(torch.equal(t, two_nodes[n]) for n, t in load_file(merged / "model.safetensors").items())
