"""An accelerate config file is read as accelerate reads it: the checker calls a top-level key unknown ("accelerate
refuses the file") exactly where accelerate's ClusterConfig refuses the file, and a key accelerate converts (its
older ``fp16`` and top-level ``dynamo_backend``) is checked as the setting it becomes, by tools/check_config.py and
by a launch's settings alike."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from conftest import ALL_CONFIGS, REPO

from fsdp_recipes.config.accelerate_config import check_config
from fsdp_recipes.config.launcher import from_launch_args
from fsdp_recipes.config.problems import errors

REFUSED = "unknown key (accelerate refuses the file)"
EXTRA = {  # top-level keys a file may add: accelerate's fields, its older keys, and keys it does not know
    "fp16 true": {"fp16": True},
    "fp16 false": {"fp16": False},
    "dynamo_backend NO": {"dynamo_backend": "NO"},
    "dynamo_backend INDUCTOR": {"dynamo_backend": "INDUCTOR"},
    "older keys both": {"fp16": True, "dynamo_backend": "NO"},
    "debug": {"debug": False},
    "enable_cpu_affinity": {"enable_cpu_affinity": False},
    "same_network": {"same_network": True},
    "a typo of dynamo_backend": {"dynamo_backends": "NO"},
    "a typo of fp16": {"fp_16": True},
    "a hyphenated key": {"mixed-precision": "bf16"},
    "an fsdp key at the top": {"fsdp_version": 2},
    "a recipe key": {"learning_rate": 1e-4},
}


def accelerate_refuses(path) -> bool:
    try:
        ClusterConfig.from_yaml_file(str(path))
    except ValueError as err:
        assert "unknown keys" in str(err), err
        return True
    return False


@pytest.mark.parametrize("extra", sorted(EXTRA))
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_a_key_is_called_refused_exactly_where_accelerate_refuses_the_file(tmp_path, config, extra):
    raw = yaml.safe_load((REPO / config).read_text())
    if "fp16" in EXTRA[extra]:
        raw.pop("mixed_precision", None)  # accelerate reads fp16 only where mixed_precision is missing
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, **EXTRA[extra]}))
    problems = check_config(path)
    refused = [p.key for p in problems if p.message == REFUSED]
    assert bool(refused) == accelerate_refuses(path), problems
    if not refused:  # what accelerate converts is checked as what it becomes: FSDP1 cannot compile
        compiles = [p for p in errors(problems) if "compiles the model" in p.message]
        assert len(compiles) == (extra == "dynamo_backend INDUCTOR" and "fsdp1/" in config), problems


@pytest.mark.parametrize("extra", ["fp16 true", "fp16 false", "dynamo_backend NO", "dynamo_backend INDUCTOR"])
def test_a_launch_reads_the_older_keys_as_accelerate_converts_them(tmp_path, extra):
    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    raw.pop("mixed_precision")
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, **EXTRA[extra]}))
    settings = from_launch_args(["--config_file", str(path), "train_fsdp.py"], tmp_path)
    accelerate = ClusterConfig.from_yaml_file(str(path))
    assert settings.config.get("mixed_precision") == accelerate.mixed_precision
    assert settings.config.get("dynamo_config", {}) == accelerate.dynamo_config
    assert "fp16" not in settings.config and "dynamo_backend" not in settings.config
