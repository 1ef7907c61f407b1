"""Recipes and flags: defaults from YAML, flags win, bad input fails before any process group starts."""

from __future__ import annotations

import functools
import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, free_port, run

from fsdp_recipes.config import dict_fields, trl_recipe
from fsdp_recipes.config.model_source import qlora_problem
from fsdp_recipes.config.parse import DEFAULT_RECIPE, parse_args
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train import preflight

RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml"))
TINY = f"config_name: {REPO}/assets/tiny-llama\n"
CORPUS = f"train_file: {REPO}/assets/data/tiny_corpus.txt\n"
# parse_args in this process: no launcher, no FSDP config
NO_FSDP = ("--allow_no_fsdp", "true")


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_default_recipe_when_no_recipe_given(tmp_path):
    model_args, data_args, plan = parse_args(["--max_steps", "20", "--output_dir", str(tmp_path), *NO_FSDP])
    training_args, _ = preflight.start(plan)
    # anchored to the repository
    assert model_args.config_name == str(REPO / "assets" / "tiny-llama")
    assert data_args.train_file == str(REPO / "assets" / "data" / "tiny_corpus.txt")
    # flag overrides the recipe's 120
    assert training_args.max_steps == 20
    # from the recipe
    assert training_args.learning_rate == 3e-3
    assert DEFAULT_RECIPE.is_file()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shipped_recipes_parse(recipe, monkeypatch):
    import huggingface_hub

    from fsdp_recipes.config import model_source

    monkeypatch.chdir(REPO)
    # a hub that has the recipes' models (this machine cannot reach it)
    for ask in ("file_exists", "repo_exists"):
        monkeypatch.setattr(huggingface_hub, ask, lambda *args, **kwargs: True)
    # its own answers
    monkeypatch.setattr(model_source, "hub_problem", functools.lru_cache(model_source.hub_problem.__wrapped__))
    text = recipe.read_text()
    # a recipe that starts from the default run's output
    if "model_name_or_path: runs/" in text:
        pytest.skip("needs the default run's output; exercised by test_chat_sft_from_local_folder")
    # QLoRA without CUDA: one clear line
    if "load_in_4bit: true" in text and (problem := qlora_problem()):
        with pytest.raises(RecipeError, match=re.escape(problem)):
            parse_args([str(recipe), "--output_dir", "/tmp/unused", *NO_FSDP])
        return
    # Liger's kernels need a GPU
    if "use_liger_kernel: true" in text and not torch.cuda.is_available():
        with pytest.raises(RecipeError, match=re.escape("use_liger_kernel=true needs ")):
            parse_args([str(recipe), "--output_dir", "/tmp/unused", *NO_FSDP])
        return
    # TrainingArguments' own checks too
    preflight.start(parse_args([str(recipe), "--output_dir", "/tmp/unused", *NO_FSDP])[2])


def test_recipe_sets_defaults_and_flags_override(tmp_path):
    path = write(tmp_path, TINY + CORPUS + "learning_rate: 1.0e-4\nblock_size: 64\n")
    _, data_args, plan = parse_args([path, "--learning_rate", "1e-5", *NO_FSDP])
    assert plan.raw.learning_rate == 1e-5
    assert data_args.block_size == 64


@pytest.mark.parametrize(
    "text, message",
    [
        (TINY + CORPUS + "learnig_rate: 3\n", "learnig_rate (did you mean learning_rate?)"),
        (CORPUS + "config_name: /nonexistent/model\n", "config_name='/nonexistent/model' does not exist"),
        (TINY + "train_file: /nonexistent.jsonl\n", "train_file='/nonexistent.jsonl': does not exist"),
        (TINY + "train_file: data.xlsx\n", "unsupported extension '.xlsx'"),
        (TINY + CORPUS + "model_name_or_path: x\n", "exactly one of model_name_or_path"),
        (TINY + CORPUS + "block_size: 2\n", "block_size=2 is less than 8: use at least 8 tokens"),
        ("- a list\n", "must be a mapping"),
        ("lr: [\n", "not valid YAML"),
        (TINY + CORPUS + "learning_rate: [1, 2]\n", "recipe key learning_rate: [1, 2] is a list; give one float"),
        (TINY + CORPUS + "max_steps: ten\n", "recipe key max_steps: 'ten' is not a whole number: give a whole number"),
        (TINY + CORPUS + "lr_scheduler_type: cosinus\n", "recipe key lr_scheduler_type: 'cosinus' is not one of"),
    ],
)
def test_bad_recipe_is_a_clear_error(tmp_path, text, message):
    with pytest.raises(RecipeError) as err:
        parse_args([write(tmp_path, text)])
    assert message in str(err.value)


def test_resume_true_without_checkpoint_is_a_clear_error(tmp_path):
    plan = parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "true", *NO_FSDP])[2]
    with pytest.raises(RecipeError, match="no complete checkpoint-N folder"):
        # the resume is decided once the process group exists (here: one process)
        preflight.decide_resume(plan)


def test_help_lists_script_and_training_arguments(capsys, monkeypatch):
    """train_fsdp.py's --help, which parse_args prints (the script itself runs it in tests/integration/
    test_docs_commands.py)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    assert exited.value.code in (0, None)
    shown = capsys.readouterr().out
    for flag in (
        "--model_name_or_path",
        "--config_name",
        "--train_file",
        "--data_format",
        "--block_size",
        "--learning_rate",
        "--allow_no_fsdp",
    ):
        assert flag in shown
    # argparse wraps lines
    text = " ".join(shown.split())
    assert "train_fsdp.py [recipe.yaml] [--flag value ...]" in text and "--resume_from_checkpoint true" in text


def test_bad_input_fails_before_training_arguments_join_the_process_group(tmp_path, monkeypatch):
    """Building TrainingArguments starts accelerate's PartialState (the process group): every check comes first."""
    from transformers import TrainingArguments

    def built(self):
        raise AssertionError("TrainingArguments was built before the input was checked")

    monkeypatch.setattr(TrainingArguments, "__post_init__", built)
    (tmp_path / "taken" / "checkpoint-3").mkdir(parents=True)
    cases = [
        ["--train_file", "/nonexistent/corpus.txt"],
        [write(tmp_path, CORPUS + "model_name_or_path: ./no-such-model\n")],
        [write(tmp_path, TINY + CORPUS + "num_train_epoch: 3\n")],
        ["--output_dir", str(tmp_path / "taken")],
    ]
    for argv in cases:
        with pytest.raises(RecipeError):
            parse_args(argv)
    # which checkpoint a resume uses is decided once, after the group starts (on rank 0, for every rank); without
    # a group, that decision needs no TrainingArguments either
    plan = parse_args(["--output_dir", str(tmp_path / "empty"), "--resume_from_checkpoint", "true", *NO_FSDP])[2]
    with pytest.raises(RecipeError, match="no complete checkpoint-N folder"):
        preflight.decide_resume(plan)


def test_model_sources_that_cannot_load(trained, tmp_path, monkeypatch):
    from fsdp_recipes.config.model_source import model_source_problem

    run_dir = trained("accelerate_configs/zero3.yaml").output_dir
    # a final model folder
    assert model_source_problem(str(run_dir / "model"), weights=True) is None
    assert f"is a training run's folder: its final model is {run_dir / 'model'}; give that" == model_source_problem(
        str(run_dir), weights=True
    )
    assert "is a sharded FSDP checkpoint: merge it first" in model_source_problem(
        str(run_dir / "checkpoint-6"), weights=True
    )
    # its tokenizer is fine
    assert model_source_problem(str(run_dir / "checkpoint-6"), weights=False) is None
    assert "without config.json" in model_source_problem(str(tmp_path), weights=True)
    assert "is a file" in model_source_problem(str(run_dir / "model" / "config.json"), weights=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    # a path, not a hub id
    assert "does not exist" in model_source_problem("outputs/my-run", weights=True)
    # online and not in the cache: the hub is asked once (this machine cannot reach it: one line, not a minute of
    # retries)
    assert "the hub cannot be reached" in model_source_problem("meta-llama/Llama-3.2-1B", weights=True)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE=1" in model_source_problem("meta-llama/Llama-3.2-1B", weights=True)


def test_a_torchrun_fsdp_config_key_trainingarguments_ignores_is_named_with_its_keys(tmp_path):
    """TrainingArguments' fsdp_config is not an accelerate config: an accelerate key in it (any of accelerate
    launch's --fsdp_* options TrainingArguments does not read) is refused with TrainingArguments' own keys, never
    sent to an accelerate config file the torchrun route does not have."""
    import argparse

    from fsdp_recipes.config.flags import accelerate_launch_options
    from fsdp_recipes.config.trainer_fsdp import check_trainer_fsdp, trainer_fsdp_keys

    keys = trainer_fsdp_keys()
    ignored = sorted(k for k in accelerate_launch_options() if k.startswith("fsdp_") and k[5:] not in keys)
    # accelerate has keys TrainingArguments does not read (fsdp_sharding_strategy, ...)
    assert ignored
    for key in ignored:
        (path := tmp_path / "fsdp.json").write_text(json.dumps({"version": 2, key: "FULL_SHARD"}))
        with pytest.raises(RecipeError) as err:
            check_trainer_fsdp(argparse.Namespace(fsdp="true", fsdp_config=str(path)))
        message = str(err.value)
        assert key in message and "accelerate launch" not in message and "reshard_after_forward" in message, message


def test_torchrun_route_fsdp_flags(tmp_path):
    import argparse

    from fsdp_recipes.config.trainer_fsdp import check_trainer_fsdp

    shipped = str(REPO / "accelerate_configs" / "torchrun" / "zero3.json")
    raw = argparse.Namespace(fsdp="true", fsdp_config=shipped)
    # the string TrainingArguments would reject
    assert check_trainer_fsdp(raw) is True and raw.fsdp is True
    assert check_trainer_fsdp(argparse.Namespace(fsdp="false", fsdp_config=None)) is False
    assert check_trainer_fsdp(argparse.Namespace(fsdp=None, fsdp_config=None)) is False
    typo = tmp_path / "fsdp.json"
    typo.write_text('{"version": 2, "fsdp_state_dict_typ": "SHARDED_STATE_DICT"}')
    with pytest.raises(RecipeError, match=r"silently ignore: fsdp_state_dict_typ \(did you mean state_dict_type\?\)"):
        check_trainer_fsdp(argparse.Namespace(fsdp="true", fsdp_config=str(typo)))
    with pytest.raises(RecipeError, match="does not exist"):
        check_trainer_fsdp(argparse.Namespace(fsdp="true", fsdp_config=str(tmp_path / "nope.json")))
    # an optimizer FSDP2 cannot step: refused on this route too (the accelerate route's check never sees it)
    with pytest.raises(
        RecipeError,
        match=r"--optim adafactor: transformers' Adafactor cannot step FSDP2's sharded \(DTensor\) parameters",
    ):
        check_trainer_fsdp(argparse.Namespace(fsdp="full_shard auto_wrap", fsdp_config=shipped, optim="adafactor"))
    version1 = tmp_path / "fsdp1.json"
    version1.write_text('{"version": 1}')
    assert check_trainer_fsdp(argparse.Namespace(fsdp="true", fsdp_config=str(version1), optim="adafactor")) is True


FSDP_WORDS = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap"]
# each option misspelt as a hand would: a letter left out, two swapped, a dash for the underscore, a plural
FSDP_TYPOS = sorted(
    (
        {w[:-1] for w in FSDP_WORDS}
        | {w[:2] + w[3] + w[2] + w[4:] for w in FSDP_WORDS}
        | {w.replace("_", "-") for w in FSDP_WORDS if "_" in w}
        | {w + "s" for w in FSDP_WORDS}
    )
    # full_shard with its two l's swapped
    - set(FSDP_WORDS)
)


@pytest.mark.parametrize("typo", FSDP_TYPOS)
def test_an_fsdp_word_trainingarguments_refuses_is_named_before_the_process_count(typo, tmp_path):
    """A word of --fsdp (the torchrun route) that TrainingArguments would refuse on every rank after start-up is
    the one line, also in a single-process launch, whose own line (2 or more processes) would come first otherwise;
    as a flag and as a recipe's list."""
    from transformers import TrainingArguments

    # the oracle: transformers' own refusal
    with pytest.raises(ValueError, match="Unknown `fsdp` option"):
        TrainingArguments._apply_legacy_fsdp_to_config(f"auto_wrap {typo}", {"version": 1})
    (recipe := tmp_path / "r.yaml").write_text(f"fsdp: [auto_wrap, {typo}]\n")
    for argv in (["--fsdp", f"auto_wrap {typo}"], [str(recipe)]):
        with pytest.raises(RecipeError) as err:
            parse_args([*argv, "--output_dir", str(tmp_path / "o")])
        assert str(err.value).startswith(f"--fsdp {typo}: not an option of TrainingArguments' fsdp"), err.value


def test_every_fsdp_word_trainingarguments_takes_passes_the_check():
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY
    from transformers.trainer_utils import FSDPOption

    from fsdp_recipes.config.trainer_fsdp import unknown_fsdp_options

    # a new option is added above, with its typos
    assert FSDP_WORDS == [o.value for o in FSDPOption]
    # TrainingArguments takes a strategy in upper case too
    taken = [*FSDP_WORDS, *FSDP_SHARDING_STRATEGY]
    assert unknown_fsdp_options(" ".join(taken)) == [] and unknown_fsdp_options(taken) == []
    assert unknown_fsdp_options(True) == unknown_fsdp_options(None) == []


def mapping_declared_fields() -> set[str]:
    """TrainingArguments' fields whose declaration takes a dict (``dict | str``), read from its type hints."""
    import types
    import typing

    from transformers import TrainingArguments

    found = set()
    for name, hint in typing.get_type_hints(TrainingArguments).items():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        if any(m is dict or typing.get_origin(m) is dict for m in (typing.get_args(hint) if union else (hint,))):
            found.add(name)
    return found


def test_every_dict_valued_field_takes_a_recipe_mapping():
    """Each field TrainingArguments declares dict | str is taken from a recipe's mapping as the JSON text it reads;
    deepspeed is refused (FSDP here) and liger_kernel_config, declared dict alone, is read as a mapping."""
    assert set(dict_fields.DICT_VALUED) == mapping_declared_fields() - {"deepspeed", "liger_kernel_config"}


TORCHRUN_ZERO3 = REPO / "accelerate_configs" / "torchrun" / "zero3.json"


def test_fsdp_config_is_a_file_json_text_or_a_recipe_mapping_as_trainingarguments_reads_it(tmp_path, monkeypatch):
    """The torchrun route's fsdp_config in each form TrainingArguments takes (a file, JSON text as a flag, a
    mapping in a recipe) is checked alike and gives TrainingArguments the same FSDP plugin as the file."""
    from unittest import mock

    from transformers import TrainingArguments

    mapping = json.loads(TORCHRUN_ZERO3.read_text())
    recipe = tmp_path / "recipe.yaml"
    tiny = {"config_name": "assets/tiny-llama", "train_file": "assets/data/tiny_corpus.txt"}
    recipe.write_text(yaml.safe_dump({**tiny, "fsdp": "true", "fsdp_config": mapping}))
    # fsdp as TrainingArguments' list of options, as recipes write it too
    listed = tmp_path / "listed.yaml"
    listed.write_text(yaml.safe_dump({**tiny, "fsdp": ["full_shard"], "fsdp_config": mapping}))
    forms = {
        "file": ["--fsdp", "true", "--fsdp_config", str(TORCHRUN_ZERO3), "--train_file", tiny["train_file"]],
        "JSON text": ["--fsdp", "true", "--fsdp_config", json.dumps(mapping), "--train_file", tiny["train_file"]],
        "recipe mapping": [str(recipe)],
        "recipe list": [str(listed)],
    }
    monkeypatch.chdir(REPO)
    # torchrun's 2 processes: FSDP over gloo needs them
    monkeypatch.setenv("WORLD_SIZE", "2")
    plugins = {}
    for form, argv in forms.items():
        _, _, plan = parse_args([*argv, "--output_dir", str(tmp_path / "out")])
        assert plan.trainer_fsdp, form
        # TrainingArguments with fsdp sets accelerate's FSDP_* variables
        with mock.patch.dict(os.environ):
            # the oracle is one process, no group
            del os.environ["WORLD_SIZE"]
            oracle = TrainingArguments(
                output_dir=str(tmp_path / "oracle"), fsdp=plan.raw.fsdp, fsdp_config=plan.raw.fsdp_config, use_cpu=True
            )
        plugins[form] = oracle.fsdp_plugin_args
    assert plugins["file"] and plugins["JSON text"] == plugins["file"] == plugins["recipe mapping"]
    assert plugins["recipe list"] == plugins["file"]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--fsdp", "true", "--fsdp_config", '{"nested": 2}'], "fsdp_config has key(s) TrainingArguments would"),
        (["--fsdp", "true", "--fsdp_config", '{"version": 2'], "--fsdp_config is not valid JSON (Expecting"),
        (["--fsdp_config", str(TORCHRUN_ZERO3)], "fsdp_config is read only with --fsdp"),
        ([{"fsdp_config": {"nested": 1}}], "fsdp_config is read only with --fsdp"),
        ([{"fsdp": "true", "fsdp_config": {"nested": 1}}], "fsdp_config has key(s) TrainingArguments would"),
        ([{"accelerator_config": {"nested": 1}}], "accelerator_config: nested is not an argument of transformers'"),
        ([{"activation_checkpointing_kwargs": {"nested": 1}}], "nested is not an argument of torch.utils.checkpoint"),
    ],
    ids=[
        "text-unknown-key",
        "text-not-json",
        "file-without-fsdp",
        "mapping-without-fsdp",
        "mapping-unknown-key",
        "accelerator_config",
        "activation_checkpointing_kwargs",
    ],
)
def test_a_dict_valued_field_s_bad_mapping_is_one_line(tmp_path, monkeypatch, argv, said):
    # a recipe
    if isinstance(argv[0], dict):
        (recipe := tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"config_name": "assets/tiny-llama", **argv[0]}))
        argv = [str(recipe)]
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError) as err:
        parse_args([*argv, "--output_dir", str(tmp_path / "out"), "--allow_no_fsdp", "true"])
    assert "\n" not in str(err.value) and said in str(err.value), str(err.value)


# a mapping each dict-valued field (but fsdp_config, above) takes, with the linear schedule of the default recipe
GOOD_MAPPINGS = {
    "accelerator_config": {"split_batches": False, "even_batches": True},
    "activation_checkpointing_kwargs": {"use_reentrant": False},
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "lr_scheduler_kwargs": {"last_epoch": -1},
}
# TrainingArguments reads a file only for these (and fsdp_config)
FILE_TAKEN = {"accelerator_config"}


def dict_forms(key: str, mapping, tmp_path: Path) -> dict[str, list[str]]:
    """The command lines that give ``key`` the value ``mapping``: as a recipe's mapping, JSON text and (where
    TrainingArguments reads one) a JSON file."""
    recipe, file = tmp_path / f"{key}.yaml", tmp_path / f"{key}.json"
    tiny = {"config_name": "assets/tiny-llama", "train_file": "assets/data/tiny_corpus.txt"}
    recipe.write_text(yaml.safe_dump({**tiny, key: mapping}))
    file.write_text(json.dumps(mapping))
    forms = {"recipe mapping": [str(recipe)], "JSON text": [f"--{key}", json.dumps(mapping)]}
    if key in FILE_TAKEN:
        forms["file"] = [f"--{key}", str(file)]
    return forms


def parsed(argv: list[str], tmp_path: Path):
    return parse_args([*argv, "--output_dir", str(tmp_path / "out"), "--allow_no_fsdp", "true"])[2].raw


@pytest.mark.parametrize("key", sorted(GOOD_MAPPINGS))
def test_each_form_of_a_dict_valued_field_gives_trainingarguments_the_same_value(key, tmp_path, monkeypatch):
    """A recipe's mapping, JSON text, or a JSON file: TrainingArguments, the oracle, gets the same mapping from each
    (a file's is read once, within bounds, and handed on as its JSON text)."""
    from transformers import TrainingArguments

    monkeypatch.chdir(REPO)
    values = {}
    for form, argv in dict_forms(key, GOOD_MAPPINGS[key], tmp_path).items():
        oracle = TrainingArguments(
            output_dir=str(tmp_path / "oracle"), use_cpu=True, **{key: getattr(parsed(argv, tmp_path), key)}
        )
        value = getattr(oracle, key)
        values[form] = value.to_dict() if hasattr(value, "to_dict") else value
    assert len(values) == 2 + (key in FILE_TAKEN) and all(v == values["JSON text"] for v in values.values()), values
    given = values["JSON text"]
    assert all(given[name] == value for name, value in GOOD_MAPPINGS[key].items())


@pytest.mark.parametrize("key", sorted(GOOD_MAPPINGS))
def test_a_dict_valued_field_s_bad_value_is_one_line_in_every_form(key, tmp_path, monkeypatch):
    """A name the field's consumer does not take, in every form; JSON that is not an object; text that is not JSON;
    and, where a file is taken, a missing file, a folder and a file that is not JSON: each refused in one line
    naming the field, before TrainingArguments would raise on every rank."""
    monkeypatch.chdir(REPO)
    cases = {
        f"{form}: unknown name": (argv, f"{key}: nested is not an argument of")
        for form, argv in dict_forms(key, {**GOOD_MAPPINGS[key], "nested": 1}, tmp_path).items()
    }
    cases["bad JSON"] = ([f"--{key}", '{"a": '], f"--{key} is not valid JSON")
    cases["too deep for json"] = ([f"--{key}", '{"a": ' * 10**5], f"--{key} is not valid JSON (maximum recursion")
    # json reads it; TrainingArguments' recursive conversion might not
    deep = "{" + '"a": {' * 40 + "}" * 41
    cases["deep JSON"] = ([f"--{key}", deep], f"--{key} nests deeper than 32 levels")
    wide = "{" + ", ".join(f'"k{i}": 1' for i in range(600)) + "}"
    cases["wide JSON"] = ([f"--{key}", wide], f"--{key} holds more than 1000 values")
    # text not starting with { is a file's path to TrainingArguments
    if key in FILE_TAKEN:
        (tmp_path / "folder").mkdir()
        (tmp_path / "junk.json").write_text("not json")
        (tmp_path / "list.json").write_text("[1, 2]")
        cases["JSON list"] = ([f"--{key}", "[1, 2]"], "'[1, 2]' does not exist: give a JSON file")
        cases["missing file"] = ([f"--{key}", str(tmp_path / "missing.json")], "does not exist: give a JSON file")
        cases["folder"] = ([f"--{key}", str(tmp_path / "folder")], "is a directory, not a file")
        os.mkfifo(tmp_path / "fifo")
        cases["FIFO"] = ([f"--{key}", str(tmp_path / "fifo")], "is a FIFO")
        cases["not JSON"] = ([f"--{key}", str(tmp_path / "junk.json")], "is not valid JSON")
        cases["list file"] = (
            [f"--{key}", str(tmp_path / "list.json")],
            "must be a mapping of keys to values, not a list",
        )
    else:
        cases["JSON list"] = ([f"--{key}", "[1, 2]"], f"--{key} '[1, 2]' is not a JSON object")
        cases["a path"] = ([f"--{key}", "kwargs.json"], f"--{key} 'kwargs.json' is not a JSON object")
    for case, (argv, said) in cases.items():
        with pytest.raises(RecipeError) as err:
            parsed(argv, tmp_path)
        assert "\n" not in str(err.value) and said in str(err.value), (case, str(err.value))


@pytest.mark.slow
def test_launches_that_would_train_without_fsdp_stop_first(tmp_path, monkeypatch):
    """No launcher, accelerate without a config, and a config with distributed_type MULTI_CPU beside an fsdp_config:
    each would train one unsharded model and exit 0; each stops before anything loads, naming the command to use.
    --allow_no_fsdp true trains without FSDP on purpose."""
    import yaml

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")] + ["WORLD_SIZE"]:
        monkeypatch.delenv(key, raising=False)
    # no default accelerate config from this machine's user
    home = tmp_path / "hf-home"
    env = {"HF_HOME": str(home)}
    out = tmp_path / "out"
    multi_cpu = tmp_path / "multi_cpu.yaml"
    config = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    multi_cpu.write_text(yaml.safe_dump({**config, "distributed_type": "MULTI_CPU"}))
    launches = {
        "accelerate launch without an FSDP config": ["accelerate", "launch", str(REPO / "train_fsdp.py")],
        "distributed_type: is 'MULTI_CPU' but the file carries fsdp_config": [
            "accelerate",
            "launch",
            "--config_file",
            str(multi_cpu),
            "--main_process_port",
            str(free_port()),
            str(REPO / "train_fsdp.py"),
        ],
    }
    for why, cmd in launches.items():
        proc = run([*cmd, "--max_steps", "2", "--output_dir", str(out)], env=env)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
        assert proc.returncode != 0 and len(errors) == 1 and why in errors[0], proc.stderr[-3000:]
        assert (
            "accelerate launch --config_file accelerate_configs/zero3.yaml train_fsdp.py" in errors[0]
            or "MULTI_CPU" in why
        )
        assert not out.exists()
    # on purpose: allowed
    parse_args(["--max_steps", "2", "--output_dir", str(out), "--allow_no_fsdp", "true"])
    with pytest.raises(
        RecipeError, match=r"no launcher: `python train_fsdp.py` runs one process\): launch with an FSDP config"
    ):
        # this process: started by pytest, no launcher
        parse_args(["--max_steps", "2", "--output_dir", str(out)])


# subprocess scenarios of 5-9 s: the full tier's, keeping the quick tier within 3 minutes
@pytest.mark.slow
def test_flags_replace_the_recipes_model_and_data_source(tmp_path, monkeypatch):
    """--model_name_or_path over the default recipe (which sets config_name) fine-tunes that model; --dataset_name
    replaces its train_file; a misspelled flag is one line with the closest one."""
    model = tmp_path / "my-model"
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")).save_pretrained(model)
    AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama").save_pretrained(model)
    # either spelling HfArgumentParser gives
    for flag in ("--model_name_or_path", "--model-name-or-path"):
        model_args, data_args, _ = parse_args([flag, str(model), "--output_dir", str(tmp_path / "o"), *NO_FSDP])
        assert (model_args.model_name_or_path, model_args.config_name, model_args.tokenizer_name) == (
            str(model),
            None,
            str(model),
        )
    assert data_args.train_file.endswith("tiny_corpus.txt")
    import huggingface_hub

    from fsdp_recipes.config import model_source

    # a hub that has it
    monkeypatch.setattr(huggingface_hub, "repo_exists", lambda *args, **kwargs: True)
    monkeypatch.setattr(model_source, "hub_problem", functools.lru_cache(model_source.hub_problem.__wrapped__))
    _, data_args, _ = parse_args(["--dataset_name", "someone/data", "--output_dir", str(tmp_path / "o"), *NO_FSDP])
    assert (data_args.dataset_name, data_args.train_file) == ("someone/data", None)
    with pytest.raises(RecipeError, match=r"unknown flag\(s\): learnig_rate \(did you mean learning_rate\?\)"):
        parse_args(["--learnig_rate", "1e-4"])
    proc = run(["python", str(REPO / "train_fsdp.py"), "--learnig_rate", "1e-4"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "train_fsdp.py: error: unknown flag(s): learnig_rate (did you mean learning_rate?); see `train_fsdp.py --help`"
    ], proc.stderr


def test_output_dir_on_a_read_only_filesystem_is_one_line(tmp_path):
    """Root writes through file modes, so the case a cluster user meets is a read-only mount: refused in parse_args."""
    import subprocess

    disk = tmp_path / "ro"
    disk.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("mounting a read-only tmpfs needs root, which this machine does not give the tests")
    try:
        with pytest.raises(
            RecipeError, match=rf"output_dir '{disk}/run': {disk} is not writable: choose a folder you can write to"
        ):
            parse_args(["--output_dir", str(disk / "run"), *NO_FSDP])
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "0"], "max_steps=0 would still train one step and save checkpoint-1"),
        (["--learning_rate=-1e-4"], "learning_rate=-0.0001 is less than 0: give a rate such as 2e-5"),
        (
            ["--block_size", "1024"],
            "block_size=1024 is longer than the model's 256 positions: use block_size 256 or less",
        ),
        (["--eval_strategy", "steps"], "eval_strategy=steps needs evaluation data: set validation_file"),
        (
            ["--validation_split_percentage", "10", "--validation_file", "x.txt"],
            "set one evaluation source, not validation_file and validation_split_percentage",
        ),
        (
            ["--validation_split_percentage", "80"],
            "validation_split_percentage=80 is more than 50: hold out between 1 and 50 percent",
        ),
        (["--load_in_4bit", "true"], "load_in_4bit (QLoRA) quantizes pre-trained weights and trains a LoRA adapter"),
        (["--use_peft", "true", "--lora_r", "0"], "lora_r=0 is less than 1: give the LoRA rank, e.g. 16"),
        (["--profile_steps", "8-5"], "profile_steps='8-5': give the first and last optimizer step to profile"),
        (["--profile_steps", "5-8", "--max_steps", "6"], "profile_steps=5-8 ends after max_steps=6"),
        (["--dataset_test_split", "test"], "dataset_test_split is a split of dataset_name"),
        (
            ["--validation_file", f"{REPO}/assets/data/tiny_chat.jsonl"],
            "is a .jsonl and train_file a .txt: give both in the same format",
        ),
    ],
)
def test_values_that_would_train_nothing_or_the_wrong_thing(argv, message, tmp_path):
    with pytest.raises(RecipeError, match=re.escape(message)):
        parse_args([*argv, "--output_dir", str(tmp_path / "o"), *NO_FSDP])


def test_learning_rate_zero_is_a_warning(tmp_path, capsys):
    """A run that checks a model loads may want the weights unchanged (test_training.py does): warned, not refused."""
    parse_args(["--learning_rate", "0", "--output_dir", str(tmp_path / "o"), *NO_FSDP])
    assert "warning: learning_rate=0: the weights will not change" in capsys.readouterr().err


def test_a_tokenizer_comes_from_its_own_files(tmp_path):
    """A config-only folder (a model trained from scratch) has no tokenizer: one line names where the tokenizer was
    looked for and the flag to pass; a tokenizer-only folder (no config.json) is a fine tokenizer."""
    tiny = REPO / "assets" / "tiny-llama"
    config_only, tokenizer_only = tmp_path / "config", tmp_path / "tokenizer"
    config_only.mkdir(), tokenizer_only.mkdir()
    (config_only / "config.json").write_bytes((tiny / "config.json").read_bytes())
    for f in tiny.glob("tokenizer*"):
        (tokenizer_only / f.name).write_bytes(f.read_bytes())
    common = ["--output_dir", str(tmp_path / "o"), *NO_FSDP]
    with pytest.raises(
        RecipeError,
        match=r"tokenizer_name='.*config' \(from config_name: none was given\) has no tokenizer files .*pass "
        r"--tokenizer_name",
    ):
        parse_args(["--config_name", str(config_only), *common])
    model_args, _, _ = parse_args(["--config_name", str(config_only), "--tokenizer_name", str(tokenizer_only), *common])
    assert model_args.tokenizer_name == str(tokenizer_only)


def test_fsdp_config_keys_are_read_from_transformers_itself():
    """The keys --fsdp_config may hold come from TrainingArguments' own code, so a key a newer transformers reads is
    accepted and one it no longer reads is refused, without a list here to go stale."""
    from fsdp_recipes.config.trainer_fsdp import keys_read, trainer_fsdp_keys

    # the keys TrainingArguments' docstring (transformers 5.23) documents for fsdp_config, not the code under test
    documented = {
        "min_num_params",
        "transformer_layer_cls_to_wrap",
        "cpu_ram_efficient_loading",
        "activation_checkpointing",
        "xla",
        "xla_fsdp_settings",
        "xla_fsdp_grad_ckpt",
        "version",
        "reshard_after_forward",
        "cpu_offload",
        "state_dict_type",
        "auto_wrap_policy",
    }
    assert documented <= trainer_fsdp_keys()
    assert not {"sharding_strategy_typo", "fsdp_state_dict_typ"} & trainer_fsdp_keys()
    source = (
        "def f(self):\n"
        "    a = self.fsdp_config['indexed']\n"
        "    b = self.fsdp_config.get('got', 1)\n"
        "    self.fsdp_config.setdefault('defaulted', False)\n"
        "    if 'tested' in self.fsdp_config:\n"
        "        pass\n"
        "    other = self.other_config.get('not_fsdp')\n"
    )
    assert keys_read(source) == {"indexed", "got", "defaulted", "tested"}


# transformers 4 name -> a transformers 5 field its line must name (None: the line says where it went instead)
TRANSFORMERS_4_NAMES = {
    "evaluation_strategy": "eval_strategy",
    "group_by_length": "train_sampling_strategy",
    "logging_dir": None,
    "no_cuda": "use_cpu",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "push_to_hub_model_id": "hub_model_id",
    "push_to_hub_organization": "hub_model_id",
    "push_to_hub_token": "hub_token",
    "include_inputs_for_metrics": "include_for_metrics",
    "include_tokens_per_second": None,
    "torchdynamo": "torch_compile_backend",
    "fsdp_min_num_params": None,
    "fsdp_transformer_layer_cls_to_wrap": None,
    "fp16_backend": None,
    "half_precision_backend": None,
    "save_safetensors": None,
    "dispatch_batches": "accelerator_config",
    "split_batches": "accelerator_config",
    # accelerate launch's DeepSpeed option, not a transformers 4 name
    "gradient_clipping": "max_grad_norm",
}


def refusal_of(tmp_path, name: str, given_as: str) -> str:
    """The one line parse_args refuses ``name: 1`` with, given as a flag or as a recipe key."""
    if given_as == "flag":
        argv = [f"--{name}", "1", "--output_dir", str(tmp_path), *NO_FSDP]
    else:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(
            f"config_name: {REPO}/assets/tiny-llama\ntrain_file: {REPO}/assets/data/tiny_corpus.txt\n{name}: 1\n"
        )
        argv = [str(recipe), "--output_dir", str(tmp_path), *NO_FSDP]
    with pytest.raises(RecipeError) as err:
        parse_args(argv)
    return str(err.value)


@pytest.mark.parametrize("name", sorted(set(TRANSFORMERS_4_NAMES) - set(trl_recipe.RENAMED)))
@pytest.mark.parametrize("given_as", ["flag", "recipe key"])
def test_a_transformers_4_name_is_told_its_transformers_5_replacement(tmp_path, name, given_as):
    """Recipes and habits from transformers 4 carry names transformers 5 removed: the line names what replaced them
    (a spelling match sent --logging_dir to logging_first_step), and the name it gives exists."""
    import dataclasses

    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    # else this transformers still has it, and the table is stale
    assert name not in fields
    message = refusal_of(tmp_path, name, given_as)
    assert "\n" not in message and "did you mean" not in message.split(name, 1)[1].split(")", 1)[0], message
    if (new := TRANSFORMERS_4_NAMES[name]) is not None:
        assert new in fields and new in message, message
    else:
        assert "transformers 5" in message or "accelerate config" in message, message


ACCELERATE_SAMPLE = [
    "mixed_precision",
    "num_processes",
    "num_machines",
    "fsdp_sharding_strategy",
    "use_cpu",
    "parallelism_config_dp_shard_size",
]


@pytest.mark.parametrize("given_as", ["flag", "recipe key"])
def test_an_accelerate_config_key_is_told_where_it_goes(tmp_path, given_as):
    """A key of accelerate's config in a recipe or on the command line is said to belong in the file given to
    accelerate launch --config_file, never matched by spelling to a recipe key (mixed_precision was "did you mean
    model_revision?"). Every accelerate key the recipe does not also take, a sample of them at once."""
    from fsdp_recipes.config.accelerate_config import _recipe_keys
    from fsdp_recipes.config.flags import known_accelerate_keys

    theirs = sorted(set().union(*known_accelerate_keys()) - _recipe_keys())
    names = [k for k in ACCELERATE_SAMPLE if k in theirs] + random.Random(0).sample(theirs, 6)
    # accelerate still has them: else the sample is stale
    assert len(set(names) & set(ACCELERATE_SAMPLE)) >= 4
    for name in dict.fromkeys(names):
        message = refusal_of(tmp_path, name, given_as)
        section = next((s for s in ("fsdp_config", "parallelism_config") if name.startswith(s.split("_")[0] + "_")), 0)
        said = f"under {section}: in the file" if section else "in the file"
        assert f"{name} (an accelerate config key: set it {said} given to accelerate launch" in message, message
        assert "did you mean" not in message, message


@pytest.mark.parametrize(
    "name", ["config_file", "config-file", "dynamo_backend", "num_cpu_threads_per_process", "max_restarts"]
)
@pytest.mark.parametrize("given_as", ["flag", "recipe key"])
def test_an_option_of_accelerate_launch_is_told_to_go_before_the_script(tmp_path, name, given_as):
    """--config_file after train_fsdp.py (launch's own options given to the script) is no "did you mean
    config_name?": it goes before train_fsdp.py on the launch's command line."""
    message = refusal_of(tmp_path, name, given_as)
    assert f"{name} (an option of accelerate launch: give it before train_fsdp.py)" in message, message
    assert "did you mean" not in message, message


RENAMED_VALUES = {"evaluation_strategy": "steps", "per_gpu_train_batch_size": 3, "per_gpu_eval_batch_size": 3}
RENAMED_VALUES |= {"push_to_hub_model_id": "me/model", "push_to_hub_token": "hf_x"}


@pytest.mark.parametrize("name", sorted(trl_recipe.RENAMED))
@pytest.mark.parametrize("given_as", ["flag", "recipe key"])
def test_a_transformers_4_name_of_a_renamed_setting_is_taken_and_said_once(tmp_path, name, given_as, capsys):
    """TRL and handbook recipes still carry transformers 4's names of settings transformers 5 only renamed: they are
    read as the new name, said once in one line."""
    import dataclasses

    from transformers import TrainingArguments

    new, value = trl_recipe.RENAMED[name], RENAMED_VALUES[name]
    assert name not in {f.name for f in dataclasses.fields(TrainingArguments)} and new in {
        f.name for f in dataclasses.fields(TrainingArguments)
    }
    recipe = tmp_path / "recipe.yaml"
    base = f"config_name: {REPO}/assets/tiny-llama\ntrain_file: {REPO}/assets/data/tiny_corpus.txt\n"
    recipe.write_text(base + ("validation_split_percentage: 10\n" if name == "evaluation_strategy" else ""))
    if given_as == "flag":
        argv = [str(recipe), f"--{name}", str(value), "--output_dir", str(tmp_path / "out"), *NO_FSDP]
    else:
        recipe.write_text(recipe.read_text() + f"{name}: {value}\n")
        argv = [str(recipe), "--output_dir", str(tmp_path / "out"), *NO_FSDP]
    _, _, plan = parse_args(argv)
    said = [line for line in capsys.readouterr().err.splitlines() if name in line]
    assert len(said) == 1 and new in said[0], said
    assert str(getattr(plan.raw, new)) == str(value)


EVAL_DATA = ("--validation_split_percentage", "10")


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--do_train", "false"), "do_train=false: this script always trains"),
        (("--do_predict", "true"), "do_predict=true: this script has no prediction step"),
        (("--do_eval", "true"), "do_eval=true needs evaluation data"),
        (("--do_eval", "false", *EVAL_DATA), "do_eval=false, but evaluation data is given"),
        (("--do_train", "true"), None),
        (("--do_eval", "true", *EVAL_DATA), None),
        (("--do_eval", "false"), None),
        ((), None),
    ],
)
def test_do_flags_the_trainer_ignores_are_refused_where_they_would_mean_otherwise(tmp_path, flags, words):
    """The Trainer never reads do_train, do_eval, do_predict; this script trains always and evaluates exactly when it
    has
    evaluation data: --do_train false trained, --do_eval true without data evaluated nothing, without a word."""
    argv = [*flags, "--output_dir", str(tmp_path), *NO_FSDP]
    if words is None:
        parse_args(argv)
    else:
        with pytest.raises(RecipeError, match=re.escape(words)):
            parse_args(argv)


@pytest.mark.parametrize(
    "metric, given, expected",
    [
        ("perplexity", None, False),
        ("eval_perplexity", None, False),
        ("perplexity", "true", True),
        ("loss", None, False),
        ("eval_loss", None, False),
    ],
)
def test_the_best_checkpoint_by_perplexity_is_the_lowest(tmp_path, metric, given, expected):
    """eval_perplexity is logged on every evaluation here; the Trainer takes a metric not ending in 'loss' as
    greater-is-better and would keep the worst checkpoint: the direction is set,
    unless greater_is_better is given. Checked on the TrainingArguments the run builds."""
    from fsdp_recipes.train import preflight

    flags = [
        "--metric_for_best_model",
        metric,
        *(("--greater_is_better", given) if given else ()),
        *EVAL_DATA,
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--save_steps",
        "2",
        "--load_best_model_at_end",
        "true",
    ]
    plan = parse_args([*flags, "--output_dir", str(tmp_path), *NO_FSDP])[2]
    training_args, _ = preflight.start(plan)
    assert training_args.greater_is_better is expected


@pytest.mark.parametrize("fsdp", ["shard_grad_op auto_wrap", "full_shard", "true"])
def test_the_trainers_fsdp_flag_beside_an_accelerate_fsdp_launch_is_refused(tmp_path, monkeypatch, fsdp):
    """It would win over the launch's config: the run would train SHARD_GRAD_OP under zero3.yaml while run_args.json
    recorded the config's FULL_SHARD. The launch's settings come from FSDP_* variables here
    (torchrun with ACCELERATE_USE_FSDP, or accelerate launch's own); without them, --fsdp is the torchrun route."""
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RecipeError, match="FSDP are both given: set FSDP in one place"):
        parse_args(["--fsdp", fsdp, "--output_dir", str(tmp_path)])
    # the launch's FSDP alone
    parse_args(["--output_dir", str(tmp_path)])


@pytest.mark.parametrize("metric", ["accuracy", "eval_ppl", "eval_f1", "bleu"])
def test_a_best_model_metric_no_evaluation_reports_is_refused_before_training(tmp_path, metric):
    """One line before training, not the Trainer's KeyError at the first evaluation with a save, mid-run."""
    with pytest.raises(RecipeError, match=f"metric_for_best_model='{metric}' is not reported"):
        parse_args(["--metric_for_best_model", metric, *EVAL_DATA, "--output_dir", str(tmp_path), *NO_FSDP])


@pytest.mark.parametrize("given_as", ["flag", "recipe mapping", "recipe JSON text"])
def test_a_mapping_valued_training_argument_takes_a_mapping(tmp_path, given_as):
    """liger_kernel_config (TrainingArguments' dict[str, bool]): HfArgumentParser's dict type refused every spelling;
    it takes JSON on the command line and a mapping (or its JSON text) in a recipe, and reaches the Trainer as one."""
    from transformers import TrainingArguments

    wanted = {"fused_linear_cross_entropy": False, "rms_norm": True}
    if given_as == "flag":
        argv = [write(tmp_path, TINY + CORPUS), "--liger_kernel_config", json.dumps(wanted)]
    elif given_as == "recipe mapping":
        argv = [write(tmp_path, TINY + CORPUS + yaml.safe_dump({"liger_kernel_config": wanted}))]
    else:
        argv = [write(tmp_path, TINY + CORPUS + yaml.safe_dump({"liger_kernel_config": json.dumps(wanted)}))]
    raw = parse_args([*argv, "--output_dir", str(tmp_path / "run"), *NO_FSDP])[2].raw
    assert raw.liger_kernel_config == wanted
    assert TrainingArguments(output_dir=str(tmp_path), liger_kernel_config=raw.liger_kernel_config).liger_kernel_config


@pytest.mark.parametrize("value", ["[1]", "1", "not json", '"text"'])
def test_a_mapping_valued_flag_that_is_no_mapping_is_one_line(tmp_path, value):
    with pytest.raises(RecipeError, match="liger_kernel_config") as err:
        parse_args(["--liger_kernel_config", value, "--output_dir", str(tmp_path), *NO_FSDP])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["gradient-clipping", "evaluation-strategy", "per-gpu-train-batch-size"])
def test_a_replaced_name_in_its_hyphen_spelling_is_told_the_same(tmp_path, name):
    """train_fsdp.py takes --max-grad-norm as --max_grad_norm: a replaced name gets its hint in either spelling."""
    message = refusal_of(tmp_path, name, "flag")
    assert TRANSFORMERS_4_NAMES[name.replace("-", "_")] in message and "accelerate launch" not in message, message
