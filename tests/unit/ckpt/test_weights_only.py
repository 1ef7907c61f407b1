"""Checkpoints holding model weights and no optimizer state, as the stock Trainer's ``save_only_model`` writes them
(config.json + model.safetensors, or shards and their index, + trainer_state.json): a model, not a resumable checkpoint.
Each is "weights only": a resume is refused in one line saying how to go on (a new run from it, or a merge), nothing
calls it INCOMPLETE, and it is never offered to nor deleted by --overwrite_output_dir, whatever its trainer_state.json
holds. The same folders with a shard missing or cut short stay incomplete, as any checkpoint cut short. And
``save_only_model`` itself is refused under every config and launch: its checkpoints cannot resume a run, and the final
model is written to output_dir/model anyway.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ALL_CONFIGS, REPO, cli, plain_checkpoint

from fsdp_recipes.ckpt.resume import check_output_dir, decide, resolve_resume
from fsdp_recipes.ckpt.status import CheckpointStatus, checkpoint_status
from fsdp_recipes.ckpt.stop_advice import how_to_go_on
from fsdp_recipes.config.accelerate_config import check_config
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.problems import errors
from fsdp_recipes.errors import RecipeError

TINY = REPO / "assets" / "tiny-llama"
# parse_args in this process: no launcher, no FSDP config
NO_FSDP = ("--allow_no_fsdp", "true")
STEP = 4
# the tiny model's 0.24M fp32 parameters: 6 shards and an index
SHARDED = "200KB"
GOOD = ["single file", "indexed shards", "no config.json", "optimizer state removed"]
DAMAGED = [
    "a missing shard",
    "a truncated shard",
    "a truncated single file",
    "a shard header cut",
    "an index naming a file outside",
]


@pytest.fixture(scope="session")
def stock_saves(tmp_path_factory) -> dict[str, Path]:
    """What the stock Trainer writes at a save with save_only_model (its _save_checkpoint: save_model, then
    trainer_state.json; no optimizer, scheduler or RNG state): one folder as one safetensors file, one sharded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerState

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    saves = {}
    for kind, shard in (("single", None), ("indexed", SHARDED)):
        folder = tmp_path_factory.mktemp(kind) / f"checkpoint-{STEP}"
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        # not read here
        torch.save({"output_dir": "stock-run", "save_only_model": True}, folder / "training_args.bin")
        TrainerState(global_step=STEP, max_steps=8, save_steps=STEP).save_to_json(str(folder / "trainer_state.json"))
        saves[kind] = folder
    assert (saves["indexed"] / "model.safetensors.index.json").is_file() and len(
        list(saves["indexed"].glob("model-*-of-*.safetensors"))
    ) > 2
    return saves


def shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("model-*-of-*.safetensors"))


def make(stock_saves, run: Path, case: str) -> Path:
    """checkpoint-STEP in ``run``: a good case or a damaged one."""
    import torch

    base = (
        "single"
        if case in ("single file", "no config.json", "optimizer state removed", "a truncated single file")
        else "indexed"
    )
    ckpt = run / f"checkpoint-{STEP}"
    shutil.copytree(stock_saves[base], ckpt)
    if case == "no config.json":
        (ckpt / "config.json").unlink()
    # a plain checkpoint whose optimizer.pt someone deleted to save space
    elif case == "optimizer state removed":
        torch.save({"last_epoch": STEP}, ckpt / "scheduler.pt")
        torch.save({"python": [0], "numpy": [0], "cpu": torch.zeros(2)}, ckpt / "rng_state.pth")
    elif case == "a missing shard":
        shards(ckpt)[1].unlink()
    elif case == "a truncated shard":
        with open(shards(ckpt)[1], "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    elif case == "a truncated single file":
        with open(ckpt / "model.safetensors", "r+b") as f:
            f.truncate(f.seek(0, 2) - 100)
    elif case == "a shard header cut":
        with open(shards(ckpt)[0], "r+b") as f:
            f.truncate(40)
    elif case == "an index naming a file outside":
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        first = next(iter(index["weight_map"]))
        index["weight_map"][first] = "../elsewhere.safetensors"
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def refusal(call) -> str:
    with pytest.raises(RecipeError) as caught:
        call()
    text = str(caught.value)
    assert "\n" not in text, text
    return text


WORDS = "holds model weights only, no optimizer state (as save_only_model writes), so it cannot resume a run"


@pytest.mark.parametrize("case", GOOD)
def test_weights_only_checkpoint_is_its_own_kind(stock_saves, tmp_path, case, capsys):
    ckpt = make(stock_saves, tmp_path / "run", case)
    status = checkpoint_status(ckpt)
    assert status.weights_only and status.may_be_good and not status.resumable and not status.may_be_complete
    assert (status.state_dict_type, status.step, status.problems) == ("WEIGHTS_ONLY", STEP, [])
    summary = status.summary()
    assert summary.startswith(
        f"checkpoint-{STEP} (step {STEP}, WEIGHTS_ONLY): WEIGHTS ONLY (complete model weights, no optimizer state"
    ), summary
    assert "INCOMPLETE" not in summary and "pytorch_model_fsdp_0" not in summary and "optimizer_0" not in summary
    assert f"tools/merge_checkpoint.py {ckpt} OUT" in summary
    # from_pretrained needs config.json
    assert (f"--model_name_or_path {ckpt}" in summary) == (case != "no config.json")
    # tools/check_checkpoint.py: the checkpoint, and the run folder (where resume true stops)
    assert cli("check_checkpoint", [str(ckpt)]) == 1
    said = capsys.readouterr().out
    assert "WEIGHTS ONLY" in said and "INCOMPLETE" not in said, said
    assert cli("check_checkpoint", [str(ckpt.parent)]) == 1
    said = capsys.readouterr().out
    assert (
        f"resume: --resume_from_checkpoint true stops at checkpoint-{STEP} (model weights only, no optimizer state)"
        in said
    ), said
    assert "INCOMPLETE" not in said and "overwrite_output_dir" not in said
    assert cli("check_checkpoint", [str(ckpt), "--json"]) == 1
    (record,) = json.loads(capsys.readouterr().out)["checkpoints"]
    assert record["weights_only"] and record["may_be_good"] and not record["resumable"]


@pytest.mark.parametrize("case", GOOD)
def test_weights_only_checkpoint_is_never_offered_for_deletion_nor_deleted(stock_saves, tmp_path, case):
    run = tmp_path / "run"
    ckpt = make(stock_saves, run, case)
    before = snapshot(run)
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=False))
    assert f"already holds another run's checkpoints (checkpoint-{STEP}); checkpoint-{STEP} {WORDS}" in text, text
    assert (
        "overwrite_output_dir" not in text and "none of them complete" not in text and "incomplete" not in text.lower()
    )
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=True))
    assert text.startswith(
        f"--overwrite_output_dir: refusing to delete {ckpt}, which may be a good model: checkpoint-{STEP} {WORDS}"
    ), text
    assert "nothing was deleted" in text
    # the line a run that stopped ends with
    said = how_to_go_on(run)
    assert said.startswith(f"checkpoint-{STEP} {WORDS}") and "overwrite_output_dir" not in said, said
    # the script's own parse: a new run into this folder, with and without --overwrite_output_dir
    for extra in ((), ("--overwrite_output_dir", "true")):
        text = refusal(lambda: parse_args(["--output_dir", str(run), *extra, *NO_FSDP]))  # noqa: B023 (called at once, in the loop)
        assert WORDS in text and (
            "overwrite_output_dir true" not in text if not extra else "refusing to delete" in text
        ), text
    assert snapshot(run) == before


@pytest.mark.parametrize("case", GOOD)
def test_resuming_a_weights_only_checkpoint_is_refused_in_one_line(stock_saves, tmp_path, case, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    run = tmp_path / "run"
    ckpt = make(stock_saves, run, case)
    before = snapshot(run)
    text = refusal(lambda: resolve_resume(str(ckpt), str(run)))
    assert text.startswith(f"cannot resume from {ckpt}: checkpoint-{STEP} {WORDS}; it is a model: "), text
    text = refusal(lambda: resolve_resume("true", str(run)))
    assert text.startswith(
        f"--resume_from_checkpoint true: the newest checkpoint in {str(run)!r} cannot resume: checkpoint-{STEP} {WORDS}"
    ), text
    assert "nothing was skipped, set aside or deleted" in text and "start without" not in text
    # the launch's one decision (global rank 0): an error, nothing to set aside
    for value in (str(ckpt), "true"):
        decision = decide(value, str(run), trainer_fsdp=True)
        assert decision.path is None and decision.set_aside == [] and WORDS in decision.error, decision
    assert "overwrite_output_dir" not in how_to_go_on(run)
    assert snapshot(run) == before


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_weights_only_checkpoints_are_incomplete_as_before(stock_saves, tmp_path, case):
    run = tmp_path / "run"
    ckpt = make(stock_saves, run, case)
    status = checkpoint_status(ckpt)
    assert not status.weights_only and not status.may_be_good and not status.resumable
    assert (
        status.state_dict_type == "WEIGHTS_ONLY"
        and status.problems
        and all(p.startswith("model weights: ") for p in status.problems)
    ), status
    expected = {
        "a missing shard": "missing model-00002-of-",
        "a truncated shard": "truncated model-00002-of-",
        "a truncated single file": "truncated model.safetensors (",
        "a shard header cut": "truncated or unreadable model-00001-of-",
        "an index naming a file outside": 'names "../elsewhere.safetensors" as a shard',
    }[case]
    assert expected in status.problems[0], status.problems
    assert status.summary().startswith(f"checkpoint-{STEP} (step {STEP}, WEIGHTS_ONLY): INCOMPLETE: model weights: "), (
        status.summary()
    )
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=False))
    assert "none of them complete" in text and "--overwrite_output_dir true to delete them" in text, text
    # what the flag is for: a save cut short
    assert check_output_dir(str(run), resuming=False, overwrite=True) == [ckpt]
    text = refusal(lambda: resolve_resume(str(ckpt), str(run)))
    assert text.startswith(
        f"cannot resume from checkpoint-{STEP} (step {STEP}, WEIGHTS_ONLY): INCOMPLETE: model weights: "
    ), text
    assert WORDS not in text


def test_whole_weights_without_trainer_state_are_a_model_all_the_same(stock_saves, tmp_path):
    """Weights whole but no trainer_state.json (the Trainer writes it last: a save killed in between), in a run of
    ours (its marker): the weights are a model, kept, and what is missing said (tests/unit/ckpt/test_weights_verdict.py
    has every other trainer_state.json)."""
    from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE
    from fsdp_recipes.removal import make_folder

    run = tmp_path / "run"
    ckpt = make_folder(run / f"checkpoint-{STEP}", CHECKPOINT_PURPOSE)
    shutil.copytree(stock_saves["single"], ckpt, dirs_exist_ok=True)
    (ckpt / "trainer_state.json").unlink()
    status = checkpoint_status(ckpt)
    assert status.weights_only and status.may_be_good and "missing trainer_state.json" in status.summary()
    assert "refusing to delete" in refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=True))


@pytest.fixture(scope="session")
def stock_adapter(tmp_path_factory) -> Path:
    """A LoRA run's save_only_model checkpoint under the stock Trainer: peft's adapter files and trainer_state.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerState

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    folder = tmp_path_factory.mktemp("adapter") / f"checkpoint-{STEP}"
    model.save_pretrained(folder)
    TrainerState(global_step=STEP).save_to_json(str(folder / "trainer_state.json"))
    return folder


@pytest.mark.parametrize("damage", [None, "truncated", "no adapter_config.json"])
def test_a_lora_adapter_saved_without_optimizer_state(stock_adapter, tmp_path, damage):
    run = tmp_path / "run"
    ckpt = run / stock_adapter.name
    shutil.copytree(stock_adapter, ckpt)
    if damage == "truncated":
        with open(ckpt / "adapter_model.safetensors", "r+b") as f:
            f.truncate(f.seek(0, 2) - 10)
    elif damage == "no adapter_config.json":
        (ckpt / "adapter_config.json").unlink()
    status = checkpoint_status(ckpt)
    assert status.state_dict_type == "WEIGHTS_ONLY" and status.weights_only == (damage is None), status
    if damage is None:
        assert (
            "it is a LoRA adapter: load it onto its base model with peft" in status.summary()
            and "INCOMPLETE" not in status.summary()
        )
        text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=False))
        assert "LoRA adapter" in text and "overwrite_output_dir" not in text, text
        assert "refusing to delete" in refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=True))
        assert "LoRA adapter" in refusal(lambda: resolve_resume(str(ckpt), str(run)))
    else:
        assert status.summary().startswith(
            f"checkpoint-{STEP} (step {STEP}, WEIGHTS_ONLY): INCOMPLETE: model weights: "
        ), status.summary()
        if damage == "truncated":
            assert check_output_dir(str(run), resuming=False, overwrite=True) == [ckpt]
        # peft's README.md without an adapter beside it: a user's folder, as before (layout.is_checkpoint_folder)
        else:
            assert "not a training checkpoint holding nothing else" in refusal(
                lambda: check_output_dir(str(run), resuming=False, overwrite=True)
            )


def test_a_newer_weights_only_checkpoint_is_not_passed_over_for_an_older_resumable_one(stock_saves, tmp_path):
    run = tmp_path / "run"
    older = plain_checkpoint(run, 2, 2)
    make(stock_saves, run, "single file")
    assert checkpoint_status(older).resumable
    before = snapshot(run)
    text = refusal(lambda: resolve_resume("true", str(run)))
    assert WORDS in text and f"--resume_from_checkpoint {older}" in text and "set aside" in text, text
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=False))
    assert WORDS in text and f"--resume_from_checkpoint {older}" in text and "overwrite_output_dir" not in text, text
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=True))
    assert f"refusing to delete {run / f'checkpoint-{STEP}'}" in text, text
    said = how_to_go_on(run)
    assert (
        WORDS in said and f"--resume_from_checkpoint {older}" in said and "resume_from_checkpoint true" not in said
    ), said
    assert snapshot(run) == before
    # resuming the older one by its path moves the weights-only one aside as replaced (a rename), deletes nothing
    resume = resolve_resume(str(older), str(run))
    assert resume.path == str(older) and [(a.path.name, a.prefix) for a in resume.set_aside] == [
        (f"checkpoint-{STEP}", "replaced-")
    ]


def test_a_complete_plain_checkpoint_is_still_resumable(tmp_path):
    status = checkpoint_status(plain_checkpoint(tmp_path / "run", 2, 2))
    assert status.resumable and status.state_dict_type == "PLAIN" and not status.weights_only


def test_overwrite_never_deletes_a_checkpoint_unreadable_by_this_version(stock_saves, tmp_path, monkeypatch):
    """The other kind that may be good (another torch version's): refused by --overwrite_output_dir too."""
    run = tmp_path / "run"
    # a checkpoint folder the flag would otherwise delete
    make(stock_saves, run, "a missing shard")
    import fsdp_recipes.ckpt.resume as resume

    monkeypatch.setattr(
        resume, "checkpoint_status", lambda p: CheckpointStatus(str(p), unreadable="dtype float8_e8m0fnu")
    )
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=True))
    assert "refusing to delete" in text and "may be complete" in text and "nothing was deleted" in text, text


@pytest.mark.parametrize("case", ["single file", "indexed shards"])
def test_the_advice_works(stock_saves, tmp_path, case):
    """What the refusal offers: a new run from the checkpoint (its parse passes, nothing to delete), and the merge."""
    from safetensors.torch import load_file

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    ckpt = make(stock_saves, tmp_path / "run", case)
    _, _, plan = parse_args(
        [
            "--model_name_or_path",
            str(ckpt),
            "--tokenizer_name",
            str(TINY),
            "--output_dir",
            str(tmp_path / "new"),
            *NO_FSDP,
        ]
    )
    assert plan.delete == []
    merge_checkpoint(ckpt, tmp_path / "merged", log=lambda *_: None)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    from safetensors import safe_open

    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                assert merged[name].equal(f.get_tensor(name)), name


SAVE_ONLY_MODEL_WORDS = "its checkpoints hold the model weights without optimizer state, so they cannot resume a run"


def test_save_only_model_is_refused_by_the_script(tmp_path):
    text = refusal(lambda: parse_args(["--save_only_model", "true", "--output_dir", str(tmp_path / "out"), *NO_FSDP]))
    assert text.startswith(f"save_only_model is refused: {SAVE_ONLY_MODEL_WORDS}"), text
    assert "output_dir/model anyway" in text and "FULL_STATE_DICT" not in text
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("save_only_model: true\n")
    assert SAVE_ONLY_MODEL_WORDS in refusal(
        lambda: parse_args([str(recipe), "--output_dir", str(tmp_path / "out"), *NO_FSDP])
    )
    # false is fine
    parse_args(["--save_only_model", "false", "--output_dir", str(tmp_path / "out"), *NO_FSDP])


def full_state_dict(tmp_path: Path) -> str:
    config = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    config["fsdp_config"]["fsdp_state_dict_type"] = "FULL_STATE_DICT"
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "full.yaml")


@pytest.mark.parametrize("config", [*ALL_CONFIGS, "FULL_STATE_DICT"])
def test_save_only_model_is_refused_under_every_config(tmp_path, config, capsys):
    path = full_state_dict(tmp_path) if config == "FULL_STATE_DICT" else str(REPO / config)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("save_only_model: true\n")
    found = [p for p in errors(check_config(path, str(recipe))) if p.key == "save_only_model"]
    assert (
        len(found) == 1 and SAVE_ONLY_MODEL_WORDS in found[0].message and "output_dir/model anyway" in found[0].message
    ), found
    assert "FULL_STATE_DICT" not in str(found[0])
    assert cli("check_config", [path, "--recipe", str(recipe)]) == 1
    assert "save_only_model" in capsys.readouterr().err
    recipe.write_text("save_only_model: false\n")
    assert not [p for p in check_config(path, str(recipe)) if p.key == "save_only_model"]


# Checkpoints whose weights are pickle files, as transformers 4's Trainer wrote them with save_safetensors=false (with
# and
# without its optimizer state) and peft's .bin adapter: never unpickled here, so never judged complete or not; kept
PICKLED = {
    "bin weights only": ["pytorch_model.bin"],
    "bin with optimizer state": ["pytorch_model.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"],
    "bin shards": [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ],
    "bin adapter": ["adapter_model.bin", "adapter_config.json"],
}


@pytest.mark.parametrize("case", sorted(PICKLED))
def test_a_checkpoint_of_pickled_weights_is_never_offered_for_deletion_nor_deleted(tmp_path, case):
    """transformers 4's .bin checkpoints are kept as ones that may be good: never called INCOMPLETE, never on
    --overwrite_output_dir's list, never deleted. The files are written as bytes: nothing here unpickles them."""
    run = tmp_path / "run"
    ckpt = run / "checkpoint-4"
    ckpt.mkdir(parents=True)
    for name in PICKLED[case]:
        (ckpt / name).write_bytes(
            b"PK\x03\x04 pickled weights, not read here" if name.endswith((".bin", ".pt", ".pth")) else b"{}"
        )
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    before = snapshot(run)
    status = checkpoint_status(ckpt)
    assert status.may_be_good and not status.resumable and "pickle files" in status.unreadable
    text = refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=False))
    assert "--overwrite_output_dir true" not in text
    refusal(lambda: check_output_dir(str(run), resuming=False, overwrite=True))
    refusal(lambda: resolve_resume("true", str(run)))
    assert snapshot(run) == before
