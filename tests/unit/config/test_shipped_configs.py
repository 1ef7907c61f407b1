"""Every shipped accelerate config loads with accelerate's own loader, passes launch validation, and documents
itself."""

from __future__ import annotations

import re

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from conftest import ALL_CONFIGS, DDP_CONFIG, FSDP_CONFIGS, REPO

HEADER_FIELDS = [
    "ZeRO",
    "NOT a DeepSpeed config",
    "Memory per GPU",
    "Choose it when",
    "Launch:",
    "Tested with:",
    "Config revision:",
]


def test_configs_are_found_recursively():
    assert "accelerate_configs/zero3.yaml" in ALL_CONFIGS
    assert any(c.startswith("accelerate_configs/fsdp1/") for c in ALL_CONFIGS)
    assert len(ALL_CONFIGS) == 10 and DDP_CONFIG in ALL_CONFIGS


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_loads_with_accelerate_loader(config):
    # raises on unknown top-level keys
    loaded = load_config_from_file(str(REPO / config))
    assert loaded.distributed_type == DistributedType.FSDP
    fsdp = loaded.fsdp_config
    assert fsdp["fsdp_version"] in (1, 2)
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert loaded.mixed_precision == "bf16"


@pytest.mark.parametrize("config", FSDP_CONFIGS)
def test_passes_accelerate_launch_validation(config):
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(REPO / config), "train_fsdp.py"])
    raw = yaml.safe_load((REPO / config).read_text())
    # accelerate copies nested keys onto the launch arguments and silently drops unknown ones: none may be unknown
    for section in ("fsdp_config", "parallelism_config"):
        for key in raw.get(section, {}):
            assert hasattr(args, key), f"{config}: {section}.{key} is not an accelerate launch setting"
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.num_processes >= 2


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_header_documents_the_config(config):
    text = (REPO / config).read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for field in HEADER_FIELDS:
        assert field in header, f"{config}: header lacks {field!r}"
    assert f"--config_file {config}" in header
    assert re.search(r"\d+P(/[NG])? bytes", header), "memory formula in terms of P and N"
    assert "torch 2.13.0, accelerate 1.15.0, transformers 5.23.0" in header
    requirements = (REPO / "requirements.txt").read_text()
    for pin in ("torch==2.13.0", "accelerate==1.15.0", "transformers==5.23.0"):
        assert pin in requirements


def test_top_level_is_fsdp2_and_fsdp1_sits_beside_it():
    for config in FSDP_CONFIGS:
        version = yaml.safe_load((REPO / config).read_text())["fsdp_config"]["fsdp_version"]
        assert version == (1 if "/fsdp1/" in config else 2), config
    strategies = {c: yaml.safe_load((REPO / c).read_text())["fsdp_config"] for c in FSDP_CONFIGS}
    assert strategies["accelerate_configs/zero3.yaml"]["fsdp_reshard_after_forward"] is True
    assert strategies["accelerate_configs/zero2.yaml"]["fsdp_reshard_after_forward"] is False
    assert strategies["accelerate_configs/zero3_offload.yaml"]["fsdp_offload_params"] is True
    assert strategies["accelerate_configs/fsdp1/zero3_offload.yaml"]["fsdp_offload_params"] is True
    fsdp1 = {c.split("/")[-1]: s["fsdp_sharding_strategy"] for c, s in strategies.items() if "/fsdp1/" in c}
    assert fsdp1 == {
        "zero3.yaml": "FULL_SHARD",
        "zero2.yaml": "SHARD_GRAD_OP",
        "zero3_offload.yaml": "FULL_SHARD",
        "no_shard.yaml": "NO_SHARD",
        "hybrid_shard.yaml": "HYBRID_SHARD",
    }


def test_ddp_config_is_plain_ddp_for_accelerate():
    """ddp.yaml: accelerate's own loader and launch validation make it a multi-GPU (DDP) launch, no FSDP."""
    loaded = load_config_from_file(str(REPO / DDP_CONFIG))
    assert loaded.distributed_type == DistributedType.MULTI_GPU and not loaded.fsdp_config
    assert loaded.mixed_precision == "bf16"
    args, _, _ = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(REPO / DDP_CONFIG), "train_fsdp.py"])
    )
    assert args.multi_gpu and not args.use_fsdp and args.num_processes >= 2
