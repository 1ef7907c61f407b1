"""GPU smoke tests: every shipped config on all visible GPUs, what the CPU cannot show. `python -m pytest -m gpu tests`
on a GPU node; skipped with a reason elsewhere.

Each config trains a ~100M-parameter Llama built from a config for 20 steps in bf16, and the test asserts the
wrapper and the sharding, the model-state bytes per GPU against tools/estimate_memory.py's formula (within 10%), a
peak CUDA memory above them, that offload lowers the peak, and that the last checkpoint merges into a folder that
loads. bench/scaling.py produces the GPU tables of bench/results/README.md.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ALL_CONFIGS, DDP_CONFIG, REPO, launch, read_json

from bench.estimate_calibration import launch_args
from fsdp_recipes.config.strategy import strategy_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: run `python -m pytest -m gpu tests` on a GPU node"
    ),
]
# 75M parameters with the tiny tokenizer's vocabulary
HIDDEN, LAYERS, STEPS = 768, 14, 20


def gpus() -> int:
    return torch.cuda.device_count()


@functools.cache
def shipped(config: str) -> dict:
    return yaml.safe_load((REPO / config).read_text())


def strategy_and_shard(config: str, n: int) -> tuple[str, int]:
    """(the estimator's strategy name, processes one parameter is split over) on one node of n GPUs."""
    strategy = strategy_of(shipped(config))
    name = strategy.memory_strategy
    # FSDP2 HSDP on one node: 2 replicas of n/2
    if strategy.fsdp_version == 2 and name == "HYBRID_SHARD":
        return name, n // 2
    # FSDP1 HYBRID_SHARD on one node: the node's GPUs
    return name, {"NO_SHARD": 1, "DDP": 1}.get(name, n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    config.hidden_size, config.num_hidden_layers, config.intermediate_size = HIDDEN, LAYERS, HIDDEN * 8 // 3 // 16 * 16
    config.num_attention_heads = config.num_key_value_heads = HIDDEN // 64
    folder = tmp_path_factory.mktemp("model-100m")
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpu_run(model_dir, tmp_path_factory):
    runs: dict[str, Path] = {}

    def get(config: str) -> Path:
        if config not in runs:
            out = tmp_path_factory.mktemp(config.replace("/", "_").removesuffix(".yaml"))
            # where offload's peak is
            profile = ("--profile_steps", "1-1") if strategy_of(shipped(config)).offload else ()
            launch(
                config,
                "--config_name",
                str(model_dir),
                "--tokenizer_name",
                str(REPO / "assets" / "tiny-llama"),
                "--max_steps",
                str(STEPS),
                "--save_steps",
                "10",
                "--logging_steps",
                "5",
                "--output_dir",
                str(out),
                *profile,
                launch_args=tuple(launch_args(config, gpus())),
            )
            runs[config] = out
        return runs[config]

    return get


def runnable(config: str) -> bool:
    return not (shipped(config).get("parallelism_config") and gpus() < 4)


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_config_trains_sharded_in_bf16_within_the_estimate(gpu_run, model_dir, config):
    from fsdp_recipes.config.memory import Setup, estimate, model_shape
    from fsdp_recipes.train.sharding import CUDA_PHASES, phase_keys

    if not runnable(config):
        pytest.skip("FSDP2 HSDP runs as 2 replicas x 2+ shards: needs 4 GPUs")
    n = gpus()
    report = read_json(gpu_run(config) / "fsdp_report.json")
    strategy, shard = strategy_and_shard(config, n)
    version = strategy_of(shipped(config)).fsdp_version
    assert report["world_size"] == n and report["device"].startswith("cuda")
    assert report["precision"]["compute"] == "bfloat16" and report["precision"]["master_weights"] == "float32"
    total = report["total_param_elements"]
    # transformers' count of the config's model, built on meta
    assert total == model_shape(str(model_dir)).params
    offload = strategy_of(shipped(config)).offload
    # FSDP2 HSDP on one node: 2 replicas of n/2 shards, which the formula calls 2 nodes of n/2
    nodes = 2 if strategy == "HYBRID_SHARD" and version == 2 else 1
    est = estimate(
        model_shape(str(model_dir)),
        Setup(strategy=strategy, nproc_per_node=n // nodes, nnodes=nodes, offload=offload, micro_batch=8, seq_len=128),
    )
    for rank in report["ranks"]:
        # accelerate wraps in DDP only with 2+ processes; FSDP wraps on one GPU too
        assert rank["wrapper"] == (
            f"FSDP{version}" if version else "DistributedDataParallel" if n > 1 else "LlamaForCausalLM"
        )
        assert rank["local_param_elements"] * shard == pytest.approx(total, rel=1e-3)
        peak = rank["peak_memory"]["cuda_max_allocated_bytes"]
        states = sum(rank["bytes"].values())
        if not offload:
            assert states == pytest.approx(est.params + est.grads + est.optimizer, rel=0.10)
            assert peak > states
        # every phase recorded (fsdp_recipes.train.sharding.CUDA_PHASES: the run saves at steps 10 and 20), and what is
        # allocated after step 1 (gradients freed) holds this rank's weights and Adam state on the GPU, or, with
        # offload, less than its weights alone
        memory = rank["peak_memory"]
        assert all(key in memory for phase in CUDA_PHASES for key in phase_keys(phase)), sorted(memory)
        held = memory[phase_keys("after_first_step")[1]]
        on_gpu = rank["bytes"]["params"] + rank["bytes"]["optimizer"]
        assert held < rank["bytes"]["params"] if offload else held >= on_gpu, (held, rank["bytes"])
        print(f"{config} rank {rank['rank']}: peak {peak / 2**30:.2f} GiB, estimate {est.gpu_total / 2**30:.2f} GiB")


def test_offload_lowers_the_peak(gpu_run):
    for plain, offload in (
        ("accelerate_configs/zero3.yaml", "accelerate_configs/zero3_offload.yaml"),
        ("accelerate_configs/fsdp1/zero3.yaml", "accelerate_configs/fsdp1/zero3_offload.yaml"),
    ):
        peaks = [
            max(
                r["peak_memory"]["cuda_max_allocated_bytes"]
                for r in read_json(gpu_run(c) / "fsdp_report.json")["ranks"]
            )
            for c in (plain, offload)
        ]
        assert peaks[1] < peaks[0], (plain, peaks)


@pytest.mark.parametrize(
    "config", ["accelerate_configs/zero3_offload.yaml", "accelerate_configs/fsdp1/zero3_offload.yaml"]
)
def test_the_profile_says_what_was_live_at_the_peak(gpu_run, config):
    """--profile_steps on CUDA: the memory viewer's snapshot, and in summary.json the allocations live at the profiled
    step's peak by the code that made them (offload's step 1 holds its whole-run peak: nothing is allocated before)."""
    out = gpu_run(config)
    summary = read_json(out / "profile" / "summary.json")
    at_peak = summary["cuda_memory_at_peak"]
    peak = read_json(out / "fsdp_report.json")["ranks"][0]["peak_memory"]["cuda_max_allocated_bytes"]
    assert (out / "profile" / "rank0.memory.pickle").stat().st_size > 0 and summary["steps"] == [1, 1]
    assert 0 < at_peak["peak_bytes"] <= peak and at_peak["events"] > 0 and not at_peak["truncated"]
    assert sum(g["bytes"] for g in at_peak["groups"]) + at_peak["other_bytes"] == at_peak["peak_bytes"]
    assert any(g["allocated_in"].startswith("torch/") for g in at_peak["groups"]), at_peak["groups"]


@pytest.mark.parametrize("config", ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml", DDP_CONFIG])
def test_last_checkpoint_merges_into_a_folder_that_loads(gpu_run, config, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    out = gpu_run(config)
    merge_checkpoint(out / f"checkpoint-{STEPS}", tmp_path / "merged", log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    final = load_file(out / "model" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in final:
            assert torch.equal(tensor, final[name]), name
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["num_hidden_layers"] == LAYERS
