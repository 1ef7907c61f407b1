"""Several nodes on one machine (loopback): the SLURM batch file as shipped, accelerate by hand, torchrun.
Real FSDP across all processes; the final model equals the same run on one node."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import QUICK, REPO, free_port, read_json
from safetensors.torch import load_file

from fsdp_recipes.ckpt.merge import merge_checkpoint

pytestmark = pytest.mark.slow

# srun, running each "node" as a local process
FAKE_SLURM = REPO / "tests" / "helpers" / "fake_slurm"


def run_nodes(commands: list[list[str]], cwd: Path, env: dict | None = None) -> list[str]:
    """Start one command per node at once (they rendezvous with each other); return each node's output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    nodes = [
        subprocess.Popen(c, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0] * len(nodes), "\n".join(log[-3000:] for log in logs)
    return logs


def assert_same_weights(model: Path, reference: Path) -> None:
    """Two model folders (a run's output_dir/model, or the merge tool's output) hold the same weights."""
    got, want = load_file(model / "model.safetensors"), load_file(reference / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def assert_sharded(report: dict, world: int, shard_group: int, wrapper: str) -> None:
    assert report["world_size"] == world and report["distributed_type"] == "FSDP"
    total = report["total_param_elements"]
    # once per replica
    assert sum(rank["local_param_elements"] for rank in report["ranks"]) == total * (world // shard_group)
    # 1/shard_group each, give or take the 474 embedding rows split 119/119/118/118
    for rank in report["ranks"]:
        assert rank["wrapper"] == wrapper and abs(rank["local_param_elements"] * shard_group - total) < 0.01 * total, (
            rank
        )


def slurm_env(nodes: int, per_node: int) -> dict:
    return {
        "SLURM_JOB_NAME": "fsdp",
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": "node[0-1]",
        "MAIN_PROCESS_IP": "127.0.0.1",
        "MAIN_PROCESS_PORT": str(free_port()),
        "GPUS_PER_NODE": str(per_node),
    }


def test_sbatch_file_as_shipped_on_two_fake_nodes(trained, tmp_path):
    """tools/slurm/train_fsdp.sbatch run by bash under a fake srun: 2 nodes, the processes per node taken from
    SLURM's GPU count (SLURM_GPUS_PER_NODE "cpu:1", typed as SLURM writes it), zero3 sharded over both, one log per
    node; the final model equals the same run on one machine, and the checkpoint both nodes wrote into one folder
    merges into it. (More processes per node through the same launch_node.sh: the hybrid test below.)"""
    # the batch file writes logs/ where it is submitted from: a copy of the repository
    repo = tmp_path / "repo"
    shutil.copytree(
        REPO, repo, ignore=shutil.ignore_patterns(".git", "runs", "logs", "__pycache__", "*.egg-info", ".pytest_cache")
    )
    shared = tmp_path / "shared-output"
    env = {**slurm_env(2, 1), "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}", "SLURM_GPUS_PER_NODE": "cpu:1"}
    del env["GPUS_PER_NODE"]
    cmd = [
        "bash",
        "tools/slurm/train_fsdp.sbatch",
        "accelerate_configs/zero3.yaml",
        *QUICK,
        "--output_dir",
        str(shared),
    ]
    run_nodes([cmd], cwd=repo, env=env)
    logs = [(repo / "logs" / f"fsdp-42-node{n}.log").read_text() for n in (0, 1)]
    assert "node 0/2" in logs[0] and "node 1/2" in logs[1] and ": 1 processes," in logs[0]
    assert "model saved to" in logs[0]

    assert_sharded(read_json(shared / "fsdp_report.json"), world=2, shard_group=2, wrapper="FSDP2")
    shards = shared / "checkpoint-12" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(2)]
    # the session's one-machine run
    assert_same_weights(shared / "model", trained("accelerate_configs/zero3.yaml").model_dir)
    merged = tmp_path / "merged"
    merge_checkpoint(shared / "checkpoint-12", merged, log=lambda *_: None)
    assert_same_weights(merged, shared / "model")


def test_hybrid_shard_shards_inside_each_node(trained, tmp_path):
    """launch_node.sh with hybrid_shard.yaml: the mesh becomes 2 replicas (nodes) x 2 shards (processes of a node)."""
    config = "accelerate_configs/hybrid_shard.yaml"
    shared = tmp_path / "shared-output"
    cmd = ["bash", str(REPO / "tools" / "slurm" / "launch_node.sh"), config, *QUICK, "--output_dir", str(shared)]
    run_nodes([["env", f"SLURM_NODEID={n}", *cmd] for n in (0, 1)], cwd=REPO, env=slurm_env(2, 2))
    assert_sharded(read_json(shared / "fsdp_report.json"), world=4, shard_group=2, wrapper="FSDP2")
    # the session's one-machine run of the same 2 x 2 mesh
    assert_same_weights(shared / "model", trained(config).model_dir)


def test_fsdp1_on_two_nodes_by_hand(trained, tmp_path):
    """README's by-hand command (accelerate's own multi-node flags) with an FSDP1 config, one process per node."""
    config = "accelerate_configs/fsdp1/zero3.yaml"
    shared, port = tmp_path / "shared-output", str(free_port())
    commands = [
        [
            "accelerate",
            "launch",
            "--config_file",
            config,
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--rdzv_backend",
            "static",
            "--same_network",
            "train_fsdp.py",
            *QUICK,
            "--output_dir",
            str(shared),
        ]
        for rank in (0, 1)
    ]
    run_nodes(commands, cwd=REPO)
    assert_sharded(read_json(shared / "fsdp_report.json"), world=2, shard_group=2, wrapper="FSDP1")
    assert_same_weights(shared / "model", trained(config).model_dir)


def test_torchrun_on_two_nodes_matches_accelerate(trained, tmp_path):
    """torchrun's own multi-node launch with TrainingArguments' --fsdp flags, the shipped fsdp_config and --bf16 true,
    as docs/multi-node.md shows it: FSDP2 over both nodes, in the precision of accelerate launch with zero3.yaml
    (mixed_precision: bf16) and bit-identical to it."""
    shared, port = tmp_path / "shared-output", str(free_port())
    commands = [
        [
            "torchrun",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "train_fsdp.py",
            "--fsdp",
            "true",
            "--fsdp_config",
            "accelerate_configs/torchrun/zero3.json",
            "--bf16",
            "true",
            *QUICK,
            "--output_dir",
            str(shared),
        ]
        for rank in (0, 1)
    ]
    run_nodes(commands, cwd=REPO)
    report = read_json(shared / "fsdp_report.json")
    assert_sharded(report, world=2, shard_group=2, wrapper="FSDP2")
    # the session's zero3.yaml run (its own fp32 launch is not needed: train_fsdp.py hands --bf16 to accelerate on
    # a CPU, where TrainingArguments alone refuses it); on a CPU without native bf16 both compute in fp32
    reference = trained("accelerate_configs/zero3.yaml")
    assert report["precision"]["compute"] == reference.report["precision"]["compute"], report["precision"]
    assert_same_weights(shared / "model", reference.model_dir)
    assert (shared / "checkpoint-12" / "pytorch_model_fsdp_0" / ".metadata").is_file()


def test_sbatch_checkpoints_requeues_and_resumes_on_sigusr1(tmp_path):
    """SLURM's early warning (--signal=B:USR1@180) reaches the batch script: both nodes' processes finish their step
    and write the checkpoint of that step, the job requeues itself, and the requeued job (SLURM_RESTART_COUNT=1)
    resumes from that checkpoint by itself and finishes."""
    import signal
    import time

    from fsdp_recipes.ckpt.status import checkpoint_status

    repo = tmp_path / "repo"
    shutil.copytree(
        REPO, repo, ignore=shutil.ignore_patterns(".git", "runs", "logs", "__pycache__", "*.egg-info", ".pytest_cache")
    )
    shared, requeued = tmp_path / "shared-output", tmp_path / "requeued"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **slurm_env(2, 1),
        "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}",
        "FAKE_SLURM_REQUEUED": str(requeued),
    }
    # the signal lands about two steps after checkpoint-6 is complete: 24 steps leave it sixteen more (on a loaded
    # machine the signal's way through bash, srun and the launcher takes steps too), and the requeued job trains
    # what is left of them
    steps = 24
    cmd = [
        "bash",
        "tools/slurm/train_fsdp.sbatch",
        "accelerate_configs/zero3.yaml",
        "--max_steps",
        str(steps),
        "--save_steps",
        "6",
        "--logging_steps",
        "2",
        "--warmup_steps",
        "2",
        "--output_dir",
        str(shared),
    ]
    job = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (shared / "checkpoint-6" / "trainer_state.json").is_file():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    output = job.communicate(timeout=300)[0]
    logs = [(repo / "logs" / f"fsdp-42-node{n}.log").read_text() for n in (0, 1)]
    assert job.returncode == 0 and "requeued job 42" in output, output + logs[0][-3000:]
    assert requeued.read_text().split() == ["42"]
    step = max(int(p.name.split("-")[1]) for p in shared.glob("checkpoint-*"))
    assert 6 < step < steps and f"stopped by SIGUSR1 after step {step}" in logs[0], logs[0][-3000:]
    assert checkpoint_status(shared / f"checkpoint-{step}").resumable and not (shared / "model").exists()

    # a job script that names a checkpoint itself: the requeued job still continues from the newest one (the
    # user's --resume_from_checkpoint is replaced, not given twice: train_fsdp.py refuses a flag with two values)
    explicit = [*cmd, "--resume_from_checkpoint", str(shared / "checkpoint-6")]
    again = subprocess.run(
        explicit, cwd=repo, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=600
    )
    logs = [(repo / "logs" / f"fsdp-42-node{n}.log").read_text() for n in (0, 1)]
    assert again.returncode == 0, again.stdout + logs[0][-3000:]
    assert (
        "requeued job (restart 1): resuming" in logs[0] and f"resuming from {shared / f'checkpoint-{step}'}" in logs[0]
    )
    assert (
        read_json(shared / "trainer_state.json")["global_step"] == steps
        and (shared / "model" / "model.safetensors").is_file()
    )


def test_fsdp1_hybrid_that_would_train_processes_apart_is_refused_before_loading(tmp_path):
    """FSDP1 HYBRID_SHARD makes a node of the devices each process sees: two nodes of one process each, on
    torchrun's route with the strategy in the environment (as accelerate's plugin reads it), trained each node alone
    and exited 0. Now every node stops before loading, in one line; and --fsdp hybrid_shard, which accelerate's FSDP1
    never reads (it ran FULL_SHARD), is refused rather than ignored."""
    v1 = tmp_path / "fsdp1.json"
    v1.write_text(
        '{"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": '
        '"SHARDED_STATE_DICT"}'
    )
    flags = ["--fsdp_config", str(v1), "--max_steps", "2", "--save_strategy", "no", "--report_to", "none"]
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                "torchrun",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(rank),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "train_fsdp.py",
                "--fsdp",
                "true",
                *flags,
                "--output_dir",
                str(tmp_path / "apart"),
            ],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, log in zip(nodes, logs):
        assert node.returncode != 0, log[-2000:]
        assert "FSDP1 HYBRID_SHARD with one device visible to each process would train every process alone" in log, log[
            -2000:
        ]
        assert "loss" not in log and not (tmp_path / "apart" / "fsdp_report.json").exists()
    ignored = subprocess.run(
        [
            "torchrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "train_fsdp.py",
            "--fsdp",
            "hybrid_shard auto_wrap",
            *flags,
            "--output_dir",
            str(tmp_path / "ignored"),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ignored.returncode != 0 and "--fsdp hybrid_shard would run as FULL_SHARD" in ignored.stdout + ignored.stderr
