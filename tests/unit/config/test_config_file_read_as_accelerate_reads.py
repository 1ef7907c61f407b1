"""An accelerate config file is read as accelerate reads it: the checker calls a top-level key unknown ("accelerate
refuses the file") exactly where accelerate's ClusterConfig refuses the file, and a key accelerate converts (its
older ``fp16`` and top-level ``dynamo_backend``) is checked as the setting it becomes, by tools/check_config.py and
by a launch's settings alike."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from conftest import ALL_CONFIGS, REPO
from helpers.accelerate_oracle import ranks_environment

from fsdp_recipes.config.accelerate_config import check_config
from fsdp_recipes.config.launcher import from_launch_args
from fsdp_recipes.config.problems import errors
from fsdp_recipes.errors import UnreadableFile

REFUSED = "unknown key (accelerate refuses the file)"
# top-level keys a file may add: accelerate's fields, its older keys, and keys it does not know
EXTRA = {
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
    "mixed_precision null": {"mixed_precision": None},
    "mixed_precision null beside fp16": {"mixed_precision": None, "fp16": True},
    "dynamo_backend null": {"dynamo_backend": None},
}


def accelerate_refuses(path) -> bool:
    try:
        load_config_from_file(str(path))
    except ValueError as err:
        assert "unknown keys" in str(err), err
        return True
    return False


@pytest.mark.parametrize("extra", sorted(EXTRA))
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_a_key_is_called_refused_exactly_where_accelerate_refuses_the_file(tmp_path, config, extra):
    raw = yaml.safe_load((REPO / config).read_text())
    if "fp16" in EXTRA[extra]:
        # accelerate reads fp16 only where mixed_precision is missing
        raw.pop("mixed_precision", None)
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, **EXTRA[extra]}))
    problems = check_config(path)
    refused = [p.key for p in problems if p.message == REFUSED]
    assert bool(refused) == accelerate_refuses(path), problems
    # a file accelerate takes is checked as what it becomes: nothing but FSDP1's compilation
    if not refused:
        compiles = [p for p in errors(problems) if "compiles the model" in p.message]
        assert errors(problems) == compiles, problems
        assert len(compiles) == (extra == "dynamo_backend INDUCTOR" and "fsdp1/" in config), problems


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_a_json_config_is_read_as_json(tmp_path, config):
    """accelerate reads a .json config with json.load: a tab-indented one (not YAML) is the same config."""
    import json

    raw = yaml.safe_load((REPO / config).read_text())
    (path := tmp_path / "config.json").write_text(json.dumps(raw, indent="\t"))
    assert not accelerate_refuses(path) and errors(check_config(path)) == []


def test_a_file_without_distributed_type_names_that_not_its_older_keys(tmp_path):
    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    del raw["distributed_type"], raw["mixed_precision"]
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "fp16": True, "dynamo_backend": "NO"}))
    problems = errors(check_config(path))
    assert [p.key for p in problems] == ["distributed_type"], problems


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


# dynamo_config entries: accelerate's options (with and without its dynamo_ prefix), wrong names, keys
DYNAMO = {
    "backend inductor": {"dynamo_backend": "inductor"},
    "backend INDUCTOR unprefixed": {"backend": "INDUCTOR"},
    "backend eager": {"dynamo_backend": "EAGER"},
    "backend misspelt": {"dynamo_backend": "inductr"},
    "backend unprefixed misspelt": {"backend": "INDUCTOR2"},
    "backend a number": {"dynamo_backend": 3},
    "mode": {"dynamo_mode": "max-autotune"},
    "mode unprefixed": {"mode": "reduce-overhead"},
    "fullgraph": {"dynamo_use_fullgraph": True},
    "dynamic unprefixed": {"use_dynamic": True},
    "regional": {"dynamo_use_regional_compilation": True},
    "a misspelt key": {"dynamo_mod": "default"},
    "a key of torch.compile": {"fullgraph": True},
    "a plural": {"dynamo_backends": "inductor"},
}


@pytest.mark.parametrize("entry", sorted(DYNAMO))
def test_a_dynamo_config_entry_is_refused_where_accelerate_fails_or_ignores_it(tmp_path, entry):
    """accelerate is the oracle: an entry that makes its launcher fail, or changes nothing it gives the ranks (each
    sample is a value other than the option's default), is an error of the check, and only such an entry."""
    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    (plain := tmp_path / "plain.yaml").write_text(yaml.safe_dump(raw))
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "dynamo_config": DYNAMO[entry]}))
    environment, base = (ranks_environment(("--config_file", str(p))) for p in (path, plain))
    fails_or_ignored = environment is None or environment == base
    [key] = DYNAMO[entry]
    refused = [p for p in errors(check_config(path)) if p.key == f"dynamo_config.{key}"]
    assert bool(refused) == fails_or_ignored, (refused, environment is None)


def compile_modes_and_misspellings() -> list[str]:
    """torch.compile's modes, and for each: cut short by one letter, a letter doubled, upper case, underscores."""
    # the oracle's own list
    from torch._inductor import list_mode_options

    modes = list(list_mode_options())
    near = [m[:-1] for m in modes] + [m + m[-1] for m in modes] + [m.upper() for m in modes]
    return sorted({*modes, *near, *(m.replace("-", "_") for m in modes if "-" in m), "", "none"})


def compiles_with(mode: str) -> bool:
    """torch.compile is the oracle: it refuses an unknown mode when it wraps the model (on every rank)."""
    import torch

    try:
        torch.compile(torch.nn.Linear(1, 1), mode=mode)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("key", ["dynamo_mode", "mode"])
def test_a_compile_mode_is_refused_exactly_where_torch_compile_refuses_it(tmp_path, key):
    """dynamo_config's mode (with or without accelerate's dynamo_ prefix) against torch.compile itself, over its modes
    and their near misses; and TrainingArguments' torch_compile_mode, which reaches torch.compile the same way."""
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.errors import RecipeError

    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    for mode in compile_modes_and_misspellings():
        (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "dynamo_config": {key: mode}}))
        refused = [p for p in errors(check_config(path)) if p.key == f"dynamo_config.{key}"]
        assert bool(refused) != compiles_with(mode), (mode, refused)
        if key == "mode":
            continue
        argv = ["--torch_compile_mode", mode, "--allow_no_fsdp", "true", "--output_dir", str(tmp_path / "out")]
        try:
            parse_args(argv)
            said = None
        except RecipeError as err:
            said = str(err)
        assert (said is None) == compiles_with(mode), (mode, said)
        assert said is None or said.startswith(f"torch_compile_mode={mode!r} is not a mode torch.compile knows")


def test_a_config_for_sagemaker_is_one_error(tmp_path):
    """accelerate reads compute_environment AMAZON_SAGEMAKER as a SageMaker config, which refuses FSDP's keys."""
    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "compute_environment": "AMAZON_SAGEMAKER"}))
    assert accelerate_refuses(path)
    [problem] = errors(check_config(path))
    assert problem.key == "compute_environment" and "LOCAL_MACHINE" in problem.fix, problem


def test_a_top_level_dynamo_backend_beside_a_dynamo_config_is_one_error(tmp_path):
    """accelerate replaces the whole dynamo_config with the older top-level key: the config's mode and regional
    compilation would be dropped without a word."""
    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    dynamo = {"dynamo_mode": "max-autotune", "dynamo_use_regional_compilation": True}
    (path := tmp_path / "config.yaml").write_text(
        yaml.safe_dump({**raw, "dynamo_backend": "INDUCTOR", "dynamo_config": dynamo})
    )
    # what accelerate keeps
    assert load_config_from_file(str(path)).dynamo_config == {"dynamo_backend": "INDUCTOR"}
    [problem] = errors(check_config(path))
    assert "drops every key of the second" in problem.message, problem
    # a launch: one line (launch_settings)
    with pytest.raises(UnreadableFile, match="drops every key of the second"):
        from_launch_args(["--config_file", str(path), "x.py"], tmp_path)


@pytest.mark.parametrize("value", ["maybe", "", 2, None])
@pytest.mark.parametrize("key", ["dynamo_use_fullgraph", "use_dynamic", "dynamo_use_regional_compilation"])
def test_a_dynamo_switch_the_ranks_cannot_read_is_one_error(tmp_path, key, value):
    """The launcher passes str(value) to the ranks, whose TorchDynamoPlugin reads it with str_to_bool: anything else
    fails on every rank, compiling or not."""
    from accelerate.utils import str_to_bool

    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "dynamo_config": {key: value}}))
    with pytest.raises(ValueError):
        str_to_bool(str(value))
    [problem] = errors(check_config(path))
    assert problem.key == f"dynamo_config.{key}" and "true or false" in problem.fix, problem
