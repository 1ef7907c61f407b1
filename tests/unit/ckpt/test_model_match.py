"""A checkpoint must match what it is loaded into. Resume: names and full shapes of every weight (layers, sizes,
LoRA targets and rank), read from the checkpoint's headers before anything loads. Checked on real checkpoints of
both FSDP versions, GPT-2 (tied embeddings) and one real launch. Merge: the shard files must be the ones each rank
wrote (shard_digests.json), and a manifest must agree with config.json before it is trusted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.ckpt.model_match import model_mismatch, omittable_names

TINY = REPO / "assets" / "tiny-llama"


def shapes(model) -> tuple[dict, set]:
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}, omittable_names(model)


def tiny(**changes):
    config = AutoConfig.from_pretrained(TINY)
    for key, value in changes.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("config", ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"])
def test_same_model_matches_others_do_not(trained, config):
    ckpt = trained(config).output_dir / "checkpoint-12"
    assert model_mismatch(ckpt, *shapes(tiny())) is None
    problem = model_mismatch(ckpt, *shapes(tiny(num_hidden_layers=2)))
    assert (
        problem and "saved from another model" in problem and "holds 18 weight(s) this model does not have" in problem
    ), problem
    problem = model_mismatch(ckpt, *shapes(tiny(intermediate_size=96)))
    assert "differ in shape" in problem and "mlp" in problem, problem
    problem = model_mismatch(ckpt, *shapes(tiny(num_hidden_layers=6)))
    assert "weight(s) of this run's model are not in it (e.g. model.layers.4" in problem, problem


def test_full_state_dict_bin_is_matched_too(trained, tmp_path):
    """A FULL_STATE_DICT checkpoint (pytorch_model_fsdp.bin, a torch.save file) is checked too: its shapes are read
    by the merge's weights-only, memory-mapped reader."""
    ckpt = (
        trained("accelerate_configs/zero3.yaml", launch_args=("--fsdp_state_dict_type", "FULL_STATE_DICT")).output_dir
        / "checkpoint-12"
    )
    assert (ckpt / "pytorch_model_fsdp.bin").is_file() and not (ckpt / "pytorch_model_fsdp_0").exists()
    assert model_mismatch(ckpt, *shapes(tiny())) is None
    # the .bin is what the resume loads: it is read even when model.safetensors lies beside it
    other = tmp_path / "checkpoint-12"
    shutil.copytree(ckpt, other)
    torch.save({"model.embed_tokens.weight": "hello", "x": [1, 2]}, other / "pytorch_model_fsdp.bin")
    problem = model_mismatch(other, *shapes(tiny()))
    assert problem and "saved from another model" in problem and "are not in it" in problem, problem
    problem = model_mismatch(ckpt, *shapes(tiny(num_hidden_layers=2)))
    assert problem and "saved from another model" in problem and "this model does not have" in problem, problem
    problem = model_mismatch(ckpt, *shapes(tiny(intermediate_size=96)))
    assert problem and "differ in shape" in problem, problem


def test_lora_settings_must_match(trained):
    from peft import LoraConfig, get_peft_model

    ckpt = trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12"
    lora = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj"]))
    problem = model_mismatch(ckpt, *shapes(lora))
    assert problem and "not in it (e.g. base_model.model." in problem, problem


def test_tied_embeddings_match(gpt2_run):
    ckpt = sorted(gpt2_run.output_dir.glob("checkpoint-*"))[-1]
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model_mismatch(ckpt, *shapes(model)) is None


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("lora", [True, False])
def test_a_checkpoint_may_leave_out_a_second_name_and_frozen_weights_only(tmp_path, tied, lora):
    """A checkpoint may leave a LoRA run's frozen base out under every name (under peft's prefix too:
    base_model.model.lm_head.weight of a tied base); any trained weight left out, under any of its names (the
    second name of a trained tied head too), is named."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    model = tiny(tie_word_embeddings=tied).to_empty(device="cpu")
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    expected, omittable = shapes(model)
    trained_names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert ("base_model.model.lm_head.weight" in omittable) == lora and trained_names.isdisjoint(omittable)
    # a full fine-tune's head, tied or not, is loaded: it must be there
    assert "lm_head.weight" not in omittable
    state = model.state_dict()
    kept = [n for n in expected if n not in omittable]
    # the least a checkpoint may hold, and everything
    for stored in (kept, list(expected)):
        save_file({n: state[n].contiguous().clone() for n in stored}, tmp_path / "model.safetensors")
        assert model_mismatch(tmp_path, expected, omittable) is None
    for dropped in (kept[0], kept[-1]):
        save_file({n: state[n].contiguous().clone() for n in kept if n != dropped}, tmp_path / "model.safetensors")
        problem = model_mismatch(tmp_path, expected, omittable)
        assert problem and "are not in it" in problem, (dropped, problem)


@pytest.fixture
def checkpoint(trained, tmp_path) -> Path:
    copy = tmp_path / "run" / "checkpoint-12"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", copy)
    return copy


@pytest.mark.parametrize("folder", ["pytorch_model_fsdp_0", "optimizer_0"])
def test_shards_swapped_between_ranks_are_named(checkpoint, folder, tmp_path, monkeypatch):
    """Two ranks' files have the same layout: the merge would write permuted rows, a resume load the wrong halves.
    The digests written once every rank finished tell them apart."""
    from fsdp_recipes.ckpt.layout import SHARD_DIGESTS
    from fsdp_recipes.ckpt.merge import merge_checkpoint
    from fsdp_recipes.ckpt.resume import resolve_resume
    from fsdp_recipes.ckpt.status import checkpoint_status
    from fsdp_recipes.errors import CheckpointError, RecipeError

    for key, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert (checkpoint / SHARD_DIGESTS).is_file() and checkpoint_status(checkpoint).resumable
    a, b = checkpoint / folder / "__0_0.distcp", checkpoint / folder / "__1_0.distcp"
    if folder == "pytorch_model_fsdp_0":
        # same layout: nothing but the contents differs
        assert a.stat().st_size == b.stat().st_size
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    problems = checkpoint_status(checkpoint).problems
    # the optimizer's files differ in size (rank 0 holds the byte records): the metadata's byte ranges see that first
    why = (
        "is not the file this checkpoint wrote"
        if folder == "pytorch_model_fsdp_0"
        else "truncated optimizer_0/__1_0.distcp"
    )
    assert problems and why in problems[0], problems
    with pytest.raises(RecipeError, match=why):
        resolve_resume(str(checkpoint), str(checkpoint.parent))
    if folder == "pytorch_model_fsdp_0":
        with pytest.raises(CheckpointError, match="__0_0.distcp is not the file this checkpoint wrote"):
            merge_checkpoint(checkpoint, tmp_path / "merged", log=lambda *_: None)
        assert not (tmp_path / "merged").exists()


def test_a_manifest_claiming_a_tie_the_config_does_not_state_is_not_trusted(checkpoint, tmp_path):
    """An edited manifest (hashes kept valid) that calls the untied head tied would drop lm_head from the merged
    folder; it disagrees with config.json, so transformers checks the weights instead, and the head is written."""
    import hashlib

    from safetensors import safe_open

    from fsdp_recipes.ckpt.layout import MANIFEST
    from fsdp_recipes.ckpt.merge import merge_checkpoint

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert (
        manifest["tied"] == [] and json.loads((checkpoint / "config.json").read_text())["tie_word_embeddings"] is False
    )
    manifest["tied"] = ["lm_head.weight"]
    manifest["files"]["config.json"] = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    merge_checkpoint(checkpoint, tmp_path / "merged", log=lambda *_: None)
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys()


def test_a_manifest_edited_with_its_hashes_does_not_vouch_for_a_config(checkpoint, tmp_path):
    """config.json edited to 3 layers and the manifest's hash of it updated to match: the merge would have written a
    3-layer config beside 4 layers of weights; transformers' check beside the copy
    refuses it in one line, and nothing is left behind."""
    import hashlib

    from fsdp_recipes.ckpt.layout import MANIFEST
    from fsdp_recipes.ckpt.merge import merge_checkpoint
    from fsdp_recipes.errors import CheckpointError

    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["config.json"] = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not|disagrees"):
        merge_checkpoint(checkpoint, tmp_path / "merged", log=lambda *_: None)
    assert not (tmp_path / "merged").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]


@pytest.mark.parametrize(
    "entry",
    [
        {"size": "x", "sha256": "0" * 64},
        {"size": -1, "sha256": "0" * 64},
        {"size": 5, "sha256": "zz"},
        {"size": 5},
        [5, "0" * 64],
        None,
        {"size": True, "sha256": "0" * 64},
    ],
)
def test_a_digest_entry_of_another_form_is_an_unreadable_record_not_a_swap(checkpoint, entry):
    """An entry of another form (a size of "x") is an unreadable record, not a shard swapped with another rank's."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    digests = checkpoint / "shard_digests.json"
    record = json.loads(digests.read_text())
    record["files"][next(iter(record["files"]))] = entry
    digests.write_text(json.dumps(record))
    problems = checkpoint_status(checkpoint).problems
    assert problems == ["unreadable shard_digests.json: copy the checkpoint again"], problems


@pytest.mark.parametrize("how", ["deleted", "fifo", "nested"])
def test_digests_announced_by_the_manifest_must_be_there(checkpoint, how, tmp_path):
    """Swapping two ranks' shards and deleting (or replacing) shard_digests.json does not hide the swap: the manifest,
    written before any shard, announces the digests."""
    from fsdp_recipes.ckpt.layout import SHARD_DIGESTS
    from fsdp_recipes.ckpt.merge import merge_checkpoint
    from fsdp_recipes.ckpt.status import checkpoint_status
    from fsdp_recipes.errors import CheckpointError

    digests = checkpoint / SHARD_DIGESTS
    digests.unlink()
    if how == "fifo":
        os.mkfifo(digests)
    elif how == "nested":
        digests.write_text("[" * 200_000 + "]" * 200_000)
    problems = checkpoint_status(checkpoint).problems
    why = "missing shard_digests.json" if how == "deleted" else "unreadable shard_digests.json"
    assert problems and why in problems[0], problems
    with pytest.raises(CheckpointError, match=why):
        merge_checkpoint(checkpoint, tmp_path / "merged", log=lambda *_: None)


def _saved_like_a_checkpoint(folder: Path, config, lora=None, tokenizer=None) -> Path:
    config.save_pretrained(folder)
    if lora is not None:
        lora.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def _live(config, lora=None, tokenizer=None):
    from fsdp_recipes.ckpt.model_match import tokenizer_record

    return (
        json.loads(config.to_json_string(use_diff=True)),
        lora.to_dict() if lora is not None else None,
        tokenizer_record(tokenizer) if tokenizer is not None else None,
    )


def _with_model(tokenizer, model: dict) -> dict:
    """tokenizer_record of ``tokenizer`` with another tokenizer.json ``model`` section (vocabulary, merges)."""
    from fsdp_recipes.ckpt.model_match import tokenizer_record

    record = tokenizer_record(tokenizer)
    return {**record, "tokenizer.json": {**record["tokenizer.json"], "model": model}}


@pytest.mark.parametrize("seed", range(4))
def test_a_checkpoint_of_the_same_shapes_but_another_model_adapter_or_tokenizer_is_named(tmp_path, seed):
    """Heads, rope, activation or norm changed with every shape kept, lora_alpha or dropout changed, or a tokenizer
    whose ids are shuffled: each is named, never resumed and trained on without a word. Generated: any key of the
    model's config.json but the free ones, any LoRA key, a shuffled vocabulary; the same settings in another order
    match."""
    import random

    from peft import LoraConfig
    from transformers import AutoTokenizer

    from fsdp_recipes.ckpt.model_match import FREE_CONFIG_KEYS, LORA_KEYS, description_mismatch

    rng = random.Random(seed)
    config, tokenizer = AutoConfig.from_pretrained(TINY), AutoTokenizer.from_pretrained(TINY)
    lora = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "k_proj"])
    ckpt = _saved_like_a_checkpoint(tmp_path / "checkpoint-4", config, lora, tokenizer)
    assert description_mismatch(ckpt, *_live(config, lora, tokenizer)) is None
    reordered = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["v_proj", "k_proj", "q_proj"])
    assert description_mismatch(ckpt, *_live(config, reordered, tokenizer)) is None

    saved = json.loads(config.to_json_string(use_diff=True))
    plain = sorted(
        k for k in set(saved) - FREE_CONFIG_KEYS - {"model_type"} if isinstance(saved[k], (bool, int, float, str))
    )
    # model_type is the class's, not a setting
    for key in rng.sample(plain, 5):
        changed = AutoConfig.from_pretrained(TINY)
        value = saved[key]
        setattr(
            changed,
            key,
            (not value)
            if isinstance(value, bool)
            else value + 1
            if isinstance(value, int)
            else (value * 0.5 if value else 0.5)
            if isinstance(value, float)
            else f"{value}-other",
        )
        problem = description_mismatch(ckpt, *_live(changed, lora, tokenizer))
        assert problem and "saved from another model" in problem and key in problem, (key, problem)
    for key in rng.sample(sorted(FREE_CONFIG_KEYS & set(saved)), min(2, len(FREE_CONFIG_KEYS & set(saved)))):
        changed = AutoConfig.from_pretrained(TINY)
        setattr(changed, key, "elsewhere" if isinstance(saved[key], str) else not saved[key])
        assert description_mismatch(ckpt, *_live(changed, lora, tokenizer)) is None, key

    changes = {
        "r": 8,
        "lora_alpha": 64,
        "lora_dropout": 0.1,
        "target_modules": ["q_proj"],
        "use_rslora": True,
        "bias": "all",
        "fan_in_fan_out": True,
    }
    key = rng.choice(sorted(changes))
    assert key in LORA_KEYS
    other = LoraConfig(
        **{
            "r": 4,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj", "k_proj"],
            key: changes[key],
        }
    )
    problem = description_mismatch(ckpt, *_live(config, other, tokenizer))
    assert problem and "other LoRA settings" in problem and key in problem, problem

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    ids = list(model["vocab"].values())
    rng.shuffle(ids)
    shuffled = {**model, "vocab": dict(zip(model["vocab"], ids))}
    problem = description_mismatch(ckpt, _live(config)[0], lora.to_dict(), _with_model(tokenizer, shuffled))
    assert problem and "another tokenizer: its tokenizer.json's vocabulary differs" in problem, problem
    # BPE applies merges in order: reordered, another tokenizer, also in the older "a b" string form of merges
    as_strings = {**model, "merges": [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]}
    saved = json.loads((ckpt / "tokenizer.json").read_text())
    (ckpt / "tokenizer.json").write_text(json.dumps({**saved, "model": as_strings}))
    assert description_mismatch(ckpt, _live(config)[0], lora.to_dict(), _with_model(tokenizer, as_strings)) is None
    for merges in (model["merges"][::-1], as_strings["merges"][::-1]):
        problem = description_mismatch(
            ckpt, _live(config)[0], lora.to_dict(), _with_model(tokenizer, {**model, "merges": merges})
        )
        assert problem and "another tokenizer" in problem, problem
    # another tool's: nothing recorded
    assert (
        description_mismatch(tmp_path / "empty", _live(config)[0], lora.to_dict(), _with_model(tokenizer, shuffled))
        is None
    )


def _other_tokenizers():
    """(what changed, how to change a fresh copy of the tiny tokenizer's folder, what the line names): every part of
    a tokenizer the vocabulary does not show, each changed alone."""

    def edit(name, change):
        def apply(folder: Path) -> None:
            data = json.loads((folder / name).read_text())
            change(data)
            (folder / name).write_text(json.dumps(data))

        return apply

    yield "normalizer", edit("tokenizer.json", lambda t: t.update(normalizer={"type": "Lowercase"})), "normalizer"
    yield (
        "pre-tokenizer",
        edit("tokenizer.json", lambda t: t.update(pre_tokenizer={"type": "Whitespace"})),
        "pre-tokenizer",
    )
    yield "decoder", edit("tokenizer.json", lambda t: t.update(decoder={"type": "Fuse"})), "decoder"
    yield (
        "an added token",
        edit(
            "tokenizer.json",
            lambda t: t["added_tokens"].append(
                {**t["added_tokens"][-1], "id": len(t["model"]["vocab"]) + 50, "content": "<|tool|>"}
            ),
        ),
        "added-tokens",
    )
    yield "eos token", edit("tokenizer_config.json", lambda c: c.update(eos_token="<|end|>")), "eos_token"
    yield "pad token", edit("tokenizer_config.json", lambda c: c.update(pad_token="<unk>")), "pad_token"
    yield (
        "chat template",
        lambda folder: (folder / "chat_template.jinja").write_text(
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ),
        "chat template",
    )


@pytest.mark.parametrize("what,change,named", list(_other_tokenizers()), ids=[w for w, *_ in _other_tokenizers()])
def test_a_checkpoint_saved_with_another_tokenizer_of_the_same_vocabulary_is_named(tmp_path, what, change, named):
    """A tokenizer of the same vocabulary with a Lowercase normalizer or another eos token is not the checkpoint's
    (comparing the vocabulary alone, transformers would write the new eos id into the next checkpoint's config).
    Each part changed alone is named; the same tokenizer, or its runtime truncation, is not."""
    from transformers import AutoTokenizer

    from fsdp_recipes.ckpt.model_match import description_mismatch, tokenizer_record

    config, tokenizer = AutoConfig.from_pretrained(TINY), AutoTokenizer.from_pretrained(TINY)
    ckpt = _saved_like_a_checkpoint(tmp_path / "checkpoint-4", config, None, tokenizer)
    live = json.loads(config.to_json_string(use_diff=True))
    # set by the library as it encodes: not what the tokenizer is
    tokenizer.backend_tokenizer.enable_truncation(16)
    assert description_mismatch(ckpt, live, None, tokenizer_record(tokenizer)) is None
    folder = tmp_path / "other"
    shutil.copytree(TINY, folder)
    change(folder)
    other = AutoTokenizer.from_pretrained(folder)
    problem = description_mismatch(ckpt, live, None, tokenizer_record(other))
    assert problem and "was saved with another tokenizer" in problem and named in problem, problem


ADAMW_GROUP = {
    "weight_decay": 0.0,
    "betas": (0.9, 0.999),
    "eps": 1e-08,
    "amsgrad": False,
    "maximize": False,
    "decoupled_weight_decay": True,
    "initial_lr": 5e-05,
    "base_lr": 5e-05,
}


@pytest.mark.parametrize("seed", range(6))
def test_a_changed_optimizer_setting_is_named_never_dropped(seed):
    """Generated: one hyperparameter of one param group changed (as a resume's load would replace it) is named with
    the flag that sets it and both values; implementation flags and the scheduled lr of the moment are not settings."""
    import random

    from fsdp_recipes.train.optimizer import optimizer_settings, overridden_settings

    rng = random.Random(seed)
    asked = [dict(ADAMW_GROUP, weight_decay=0.01), dict(ADAMW_GROUP)]
    assert overridden_settings(asked, [dict(g) for g in asked], "checkpoint-6") is None
    group, key = rng.randrange(2), rng.choice(sorted(ADAMW_GROUP))
    loaded = [dict(g) for g in asked]
    old = loaded[group][key]
    loaded[group][key] = (
        (old[0], round(rng.uniform(0.5, 0.89), 3))
        if isinstance(old, tuple)
        else (not old)
        if isinstance(old, bool)
        else old * rng.choice([2, 10, 0.5]) + (0.1 if old == 0 else 0)
    )
    problem = overridden_settings(asked, loaded, "checkpoint-6")
    flag = {
        "initial_lr": "--learning_rate",
        "base_lr": "--learning_rate",
        "weight_decay": "--weight_decay",
        "betas": "--adam_beta1/--adam_beta2",
        "eps": "--adam_epsilon",
    }.get(key, key)
    assert (
        problem and flag in problem and "checkpoint-6 was trained with" in problem and f"param group {group}" in problem
    ), (key, problem)

    # the scheduled lr and how torch computes (foreach, fused) are no settings
    class Optimizer:
        param_groups = [
            dict(ADAMW_GROUP, params=[], lr=1e-7, foreach=True, fused=None, capturable=False, differentiable=False)
        ]

    class Scheduler:
        base_lrs = [5e-05]

    # torch.save gives the betas back as a list
    as_saved = [dict(g, betas=list(g["betas"])) for g in asked]
    assert overridden_settings(asked, as_saved, "checkpoint-6") is None
    settings = optimizer_settings(Optimizer, Scheduler)
    assert settings == [ADAMW_GROUP]
    Optimizer.param_groups[0].update(lr=3e-5, foreach=False)
    assert overridden_settings(settings, optimizer_settings(Optimizer, Scheduler), "checkpoint-6") is None
