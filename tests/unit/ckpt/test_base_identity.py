"""A LoRA adapter names its base by path or hub id; the bytes behind the name may change. The run records the base's
identity (fsdp_recipes.ckpt.base_identity) in its saved base, every checkpoint and the adapter folder; a resume and
a merge given another base (replaced, zeroed, truncated, one weight edited) stop in one line, naming what differs.

Each kind of change is generated here on a small base written with safetensors; the identity must see every one
and must not see what does not change the weights (how they are split into files, headers, bookkeeping keys)."""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, rewrite_weights, run
from safetensors.torch import load_file, save_file

from fsdp_recipes.ckpt import base_identity
from fsdp_recipes.errors import CheckpointError

CONFIG = {
    "model_type": "llama",
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "vocab_size": 32,
    "architectures": ["LlamaForCausalLM"],
    "transformers_version": "5.23.0",
    "dtype": "float32",
    "use_cache": True,
    "_name_or_path": "somewhere",
}


def make_base(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"model.layers.{i}.{n}.weight": torch.randn(8, 16, generator=g) for i in range(2) for n in ("q_proj", "v_proj")
    }
    tensors["model.embed_tokens.weight"] = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return tensors


def flip_byte(folder: Path, rng: random.Random) -> str:
    """One bit of one byte inside one tensor's data, at a random place."""
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    entries = {k: v for k, v in json.loads(raw[8:header]).items() if k != "__metadata__"}
    name = rng.choice(sorted(entries))
    begin, end = entries[name]["data_offsets"]
    raw[header + rng.randrange(begin, end)] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(raw))
    return name


def edit_config(folder: Path, **changes) -> None:
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **changes}))


# name -> (edit of the base folder, what the difference names)
CHANGES = {
    "zeroed": (
        lambda f: rewrite_weights(f, lambda t: [v.zero_() for v in t.values()]),
        r"5 of 5 weight\(s\) hold other values",
    ),
    "another seed": (lambda f: make_base(f, seed=1), r"5 of 5 weight\(s\) hold other values"),
    "one weight scaled": (
        lambda f: rewrite_weights(f, lambda t: t["model.layers.1.v_proj.weight"].mul_(1.0001)),
        r"1 of 5 .*model\.layers\.1\.v_proj",
    ),
    "a dtype": (
        lambda f: rewrite_weights(
            f, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].float()})
        ),
        r"1 of 5 .*embed_tokens",
    ),
    "a shape": (
        lambda f: rewrite_weights(
            f, lambda t: t.update({"model.layers.0.q_proj.weight": t["model.layers.0.q_proj.weight"].reshape(16, 8)})
        ),
        r"1 of 5 .*layers\.0\.q_proj",
    ),
    "a weight renamed": (
        lambda f: rewrite_weights(
            f, lambda t: t.update({"model.layers.0.k_proj.weight": t.pop("model.layers.0.q_proj.weight")})
        ),
        r"1 weight\(s\) missing \(e\.g\. model\.layers\.0\.q_proj\.weight\); 1 weight\(s\) it did not have",
    ),
    "a weight dropped": (
        lambda f: rewrite_weights(f, lambda t: t.pop("model.layers.1.q_proj.weight")),
        r"1 weight\(s\) missing",
    ),
    "a weight added": (
        lambda f: rewrite_weights(f, lambda t: t.update({"lm_head.weight": torch.ones(32, 16)})),
        r"1 weight\(s\) it did not have \(e\.g\. lm_head",
    ),
    "the config": (lambda f: edit_config(f, rope_theta=1.0), r"config\.json describes another model"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_of_the_weights_or_config_is_named(tmp_path, change):
    make_base(tmp_path)
    recorded = base_identity.identity(tmp_path)
    edit, named = CHANGES[change]
    edit(tmp_path)
    diff = base_identity.difference(recorded, base_identity.identity(tmp_path))
    assert diff is not None and re.search(named, diff), diff


def test_any_single_flipped_bit_is_seen(tmp_path):
    rng = random.Random(1234)
    make_base(tmp_path)
    recorded = base_identity.identity(tmp_path)
    # 20 places drawn at random: each a different base
    for _ in range(20):
        make_base(tmp_path)
        name = flip_byte(tmp_path, rng)
        diff = base_identity.difference(recorded, base_identity.identity(tmp_path))
        assert diff == f"1 of 5 weight(s) hold other values, dtype or shape (e.g. {name})", diff


def test_what_does_not_change_the_weights_keeps_the_identity(tmp_path):
    """Re-sharded into several files with an index, the header's order and metadata changed, config keys that
    transformers rewrites on each save: still the same base."""
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = make_base(tmp_path / "a")
    recorded = base_identity.identity(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=600)
    assert len(split.filename_to_tensors) > 1
    for file, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in reversed(names)}, b / file, metadata={"format": "pt", "note": "re-saved"})
    (b / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": split.tensor_to_filename})
    )
    (b / "config.json").write_text(
        json.dumps(
            {
                **CONFIG,
                "transformers_version": "9.0",
                "dtype": "bfloat16",
                "use_cache": False,
                "architectures": ["Other"],
                "_name_or_path": "elsewhere",
            }
        )
    )
    assert base_identity.difference(recorded, base_identity.identity(b)) is None


def test_a_truncated_or_missing_base_is_refused_in_one_line(tmp_path):
    make_base(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        base_identity.identity(tmp_path)
    path.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        base_identity.identity(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[]",
        '{"format": 1}',
        '{"format": 2, "config_sha256": "x", "tensors": {}}',
        '{"format": 1, "config_sha256": "x", "tensors": {"a": 1}}',
    ],
)
def test_a_record_that_is_not_one_is_refused(tmp_path, content):
    (tmp_path / base_identity.BASE_IDENTITY).write_text(content)
    with pytest.raises(CheckpointError, match="is not a base identity record"):
        base_identity.read(tmp_path)
    (tmp_path / base_identity.BASE_IDENTITY).unlink()
    # a folder under its name
    (tmp_path / base_identity.BASE_IDENTITY).mkdir()
    with pytest.raises(CheckpointError, match="is not a base identity record"):
        base_identity.read(tmp_path)


def adapter_only_checkpoint(tmp_path: Path, base_extra=None):
    """A tiny Llama base (save_pretrained; ``base_extra(config)``: tensors added to its file) and a checkpoint holding
    only its LoRA adapter, as FSDPTrainer saves it, with the base's identity recorded beside adapter_config.json.
    Returns (base, checkpoint), and with ``base_extra`` also the peft model."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    base, ckpt = tmp_path / "base", tmp_path / "run" / "checkpoint-3"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    if base_extra is not None:
        _with_extra(base, base_extra(config))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    dcp.save(
        {"model": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}},
        checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"),
        no_dist=True,
    )
    model.peft_config["default"].save_pretrained(str(ckpt))
    base_identity.write(ckpt, base_identity.identity(base))
    return (base, ckpt) if base_extra is None else (base, ckpt, model)


def test_a_merge_onto_another_base_than_the_recorded_one_stops_before_writing(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    base, ckpt = adapter_only_checkpoint(tmp_path)
    # the base adapter_config.json names, as recorded
    merge_checkpoint(ckpt, tmp_path / "merged")
    AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    rng = random.Random(7)
    for kind in ("one bit", "zeroed", "truncated"):
        other = tmp_path / kind
        shutil.copytree(base, other)
        if kind == "one bit":
            flip_byte(other, rng)
        elif kind == "zeroed":
            rewrite_weights(other, lambda t: [v.zero_() for v in t.values()])
        else:
            (other / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes()[:-64])
        expected = (
            f"{other}/model.safetensors is truncated"
            if kind == "truncated"
            else rf"the base model {other} is not the one {ckpt} was trained on"
        )
        with pytest.raises(CheckpointError, match=expected):
            merge_checkpoint(ckpt, tmp_path / f"out-{kind}", base_model=str(other))
        assert not (tmp_path / f"out-{kind}").exists()
    done = run(
        [
            sys.executable,
            "tools/merge_checkpoint.py",
            str(ckpt),
            str(tmp_path / "cli"),
            "--base-model",
            str(tmp_path / "zeroed"),
        ]
    )
    lines = done.stderr.strip().splitlines()
    assert (
        done.returncode != 0 and len(lines) == 1 and "hold other values" in lines[0] and "--base-model" in lines[0]
    ), done.stderr
    assert not (tmp_path / "cli").exists()

    from fsdp_recipes.ckpt.status import checkpoint_status

    # what check_checkpoint.py prints
    assert f"LoRA adapter only (base {base})" in checkpoint_status(ckpt).summary()
    # the adapter folder keeps naming its base
    merge_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True)
    assert base_identity.read(tmp_path / "adapter") == base_identity.read(ckpt)
    # a checkpoint of another tool: merged, and said it was not checked
    (ckpt / base_identity.BASE_IDENTITY).unlink()
    assert "LoRA adapter only (base not recorded: no base_identity.json)" in checkpoint_status(ckpt).summary()
    said = []
    merge_checkpoint(ckpt, tmp_path / "unchecked", base_model=str(tmp_path / "zeroed"), log=said.append)
    assert any(
        f"no {base_identity.BASE_IDENTITY} beside adapter_config.json" in s and "is not checked" in s for s in said
    ), said


def test_a_hub_base_is_found_in_the_local_cache_and_checked(tmp_path, monkeypatch):
    """A hub id the run downloaded: its snapshot in the cache is the base (nothing is downloaded), checked like a
    folder."""
    from fsdp_recipes.ckpt.merge import merge_checkpoint

    base, ckpt = adapter_only_checkpoint(tmp_path)
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(base, snapshot)
    # a hub model's own tokenizer, which the merge copies
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / name, snapshot / name)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    # read at import: never a network try from this test
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert base_identity.local_folder("someone/tiny") == snapshot
    assert base_identity.local_folder("someone/absent") is None
    said = []
    merge_checkpoint(ckpt, tmp_path / "from-hub", base_model="someone/tiny", log=said.append)
    assert f"adapter-only LoRA checkpoint: the frozen base's weights from {snapshot}" in said
    rewrite_weights(snapshot, lambda t: t["model.norm.weight"].mul_(2))
    with pytest.raises(
        CheckpointError, match=rf"the base model {snapshot} is not the one .* 1 of 39 weight\(s\) .*model\.norm\.weight"
    ):
        merge_checkpoint(ckpt, tmp_path / "changed", base_model="someone/tiny")


def test_the_resume_check_compares_what_it_can_and_refuses_what_it_cannot(tmp_path):
    """train/modeling.py's check before a LoRA resume, on its own: the same base passes; another one, or a base with no
    safetensors weights to compare while the checkpoint records one, is the one-line problem every rank raises."""
    from fsdp_recipes.train.modeling import _base_identity

    base, ckpt = tmp_path / "base", tmp_path / "checkpoint-2"
    make_base(base)
    ckpt.mkdir()
    base_identity.write(ckpt, base_identity.identity(base))
    said = []
    record, problem = _base_identity(str(base), str(ckpt), said.append)
    assert problem is None and record["tensors"] == base_identity.read(ckpt)["tensors"]
    # a fresh run: recorded, nothing to compare
    record, problem = _base_identity(str(base), None, said.append)
    assert problem is None and record is not None
    make_base(base, seed=3)
    record, problem = _base_identity(str(base), str(ckpt), said.append)
    assert (
        record is None
        and problem.startswith(f"the base model {base} is not the one {ckpt} was trained on")
        and "5 of 5" in problem
    )
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    record, problem = _base_identity(str(base), str(ckpt), said.append)
    assert record is None and "has no local safetensors weights to compare" in problem
    # an older checkpoint: nothing to compare, said once
    (ckpt / base_identity.BASE_IDENTITY).unlink()
    assert (
        _base_identity(str(base), str(ckpt), said.append) == (None, None)
        and "no local safetensors weights to record" in said[-1]
    )


def test_a_folder_with_both_a_single_file_and_an_index_is_the_single_file(tmp_path):
    """from_pretrained loads model.safetensors when both are there: the identity (and the merge) read the same file,
    not the index's shards beside it."""
    from huggingface_hub import split_torch_state_dict_into_shards

    make_base(tmp_path)
    recorded = base_identity.identity(tmp_path)
    other = {n: torch.zeros_like(t) for n, t in load_file(tmp_path / "model.safetensors").items()}
    split = split_torch_state_dict_into_shards(other, max_shard_size=600)
    for file, names in split.filename_to_tensors.items():
        save_file({n: other[n] for n in names}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": split.tensor_to_filename})
    )
    assert base_identity.difference(recorded, base_identity.identity(tmp_path)) is None


def _with_extra(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_base_with_tensors_from_pretrained_ignores_merges_without_them(tmp_path):
    """An old Llama folder stores every layer's rotary_emb.inv_freq (a buffer since moved to the model and not
    saved): from_pretrained loads it without a word, so the adapter-only merge takes it as that base and leaves those
    tensors out (it refused it as 'weights LlamaForCausalLM does not have'). A tensor from_pretrained would only
    warn about is still refused: it may be another model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    head = config.hidden_size // config.num_attention_heads
    base, ckpt, model = adapter_only_checkpoint(
        tmp_path,
        lambda c: {
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(head // 2) for i in range(c.num_hidden_layers)
        },
    )
    said = []
    merge_checkpoint(ckpt, tmp_path / "merged", log=said.append)
    assert any(
        f"{config.num_hidden_layers} stored tensor(s) left out that from_pretrained ignores too" in s for s in said
    ), said
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert not [n for n in merged if "inv_freq" in n]
    expected = model.merge_and_unload().state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert all(torch.equal(loaded[n], expected[n]) for n in merged)
    other = tmp_path / "other"
    shutil.copytree(base, other)
    _with_extra(other, {"model.layers.0.mlp.gate_proj.bias": torch.zeros(config.intermediate_size)})
    with pytest.raises(
        CheckpointError, match=r"1 weight\(s\) it did not have \(e.g. model.layers.0.mlp.gate_proj.bias\)"
    ):
        # the recorded base's identity says so first
        merge_checkpoint(ckpt, tmp_path / "out-other", base_model=str(other))
    # without that record, the model's own weights say so
    (ckpt / base_identity.BASE_IDENTITY).unlink()
    with pytest.raises(
        CheckpointError, match=r"weight\(s\) LlamaForCausalLM does not \(e.g. \S*model.layers.0.mlp.gate_proj.bias\)"
    ):
        merge_checkpoint(ckpt, tmp_path / "out-other", base_model=str(other))
    assert not (tmp_path / "out-other").exists()


@pytest.mark.parametrize("seed", range(3))
def test_only_what_transformers_drops_on_load_is_dropped(seed):
    """Generated stored names against transformers' own rule (its _adjust_missing_and_unexpected_keys on the model
    built from the config): the old per-layer inv_freq and position_ids buffers are dropped, anything else beside the
    model's weights is refused."""
    from transformers import AutoConfig

    from fsdp_recipes.ckpt.description import model_skeleton
    from fsdp_recipes.ckpt.namespace import match_namespace
    from fsdp_recipes.ckpt.readers import TensorInfo

    rng = random.Random(seed)
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    model_cls, expected, tied, ignorable = model_skeleton(config)
    layer = rng.randrange(config.num_hidden_layers)
    # Llama has inv_freq buffers (so old per-layer ones are dropped) and no position_ids buffer (so those are warned
    # about by from_pretrained, and refused here)
    droppable = [
        f"model.layers.{layer}.self_attn.rotary_emb.inv_freq",
        "model.rotary_emb.inv_freq",
        f"model.layers.{rng.randrange(config.num_hidden_layers)}.self_attn.rotary_emb.inv_freq",
    ]
    refused = [
        f"model.layers.{layer}.self_attn.inv_freq",
        f"model.layers.{layer}.mlp.rotary_emb",
        "model.norm.bias",
        "position_ids",
        "model.embed_tokens.position_ids",
        "lm_head.bias",
    ]

    def stored(names):
        info = {n: TensorInfo(shape, "float32") for n, shape in expected.items()}
        info.update({n: TensorInfo((4,), "float32") for n in names})
        return info

    picked = sorted(set(rng.sample(droppable, rng.randrange(1, len(droppable) + 1))))
    weights = match_namespace(stored(picked), expected, tied, model_cls.__name__, ignorable)
    assert sorted(weights.dropped) == sorted(picked) and set(weights.names) == set(expected) - set(tied)
    for name in refused:
        with pytest.raises(CheckpointError, match="does not"):
            match_namespace(stored(picked + [name]), expected, tied, model_cls.__name__, ignorable)
    # without the rule (a caller that gives none) nothing is dropped
    with pytest.raises(CheckpointError, match="does not"):
        match_namespace(stored(picked), expected, tied, model_cls.__name__)
