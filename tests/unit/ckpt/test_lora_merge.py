"""LoRA merges (fsdp_recipes.ckpt.lora_merge): an adapter_config.json value that cannot merge (a NaN, negative or
huge alpha, a rank past any model, a flag or list of the wrong type) is refused naming the key, and every value peft
writes is taken; a config whose r is not the adapter's, and a merge whose result is not finite, are refused before
anything is written; peft's own config merges a peft model bit for bit as merge_and_unload does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO

NAN, INF = float("nan"), float("inf")
# key -> values that would merge into NaN or wrong weights (or that peft cannot load), each refused naming the key
BAD_ADAPTER_VALUES = {
    "lora_alpha": [NAN, INF, -INF, -16, -0.5, 0, 0.0, 2**20 + 1, 1e300, "16", True, False, None, [16], {"a": 16}],
    "r": [10**12, 65537, 0, -1, 1.5, 8.0, NAN, INF, True, False, "8", None, [8]],
    "lora_dropout": [NAN, INF, -INF, -0.1, 1, 1.0, 1.5, "0.1", True, None, [0.1]],
    **{
        flag: ["false", "true", 0, 1, None, [], {}]
        for flag in ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias")
    },
    "peft_type": [1, None, ["LORA"], {}],
    "base_model_name_or_path": [5, ["base"], {"path": "base"}, True],
    "target_modules": [5, True, {"q_proj": 1}, [1, 2], ["q_proj", None]],
    "rank_pattern": [[], "q_proj", 8],
    "alpha_pattern": [[], "q_proj", 8],
    "modules_to_save": ["lm_head", 1, {}],
    "layer_replication": ["0-4", 1, {}],
}
# the ends of each range, and what peft itself writes
GOOD_ADAPTER_VALUES = {
    "lora_alpha": [1, 0.5, 1e-3, 16, 2**20, 32.0],
    "r": [1, 8, 65536],
    "lora_dropout": [0, 0.0, 0.05, 0.999],
    "use_rslora": [True, False],
    "fan_in_fan_out": [False, True],
    "use_dora": [False],
    "lora_bias": [False],
    "base_model_name_or_path": [None, "meta-llama/Llama-3.2-1B"],
    "target_modules": [None, "all-linear", ["q_proj"], []],
    "rank_pattern": [None, {}, {"q_proj": 4}],
    "alpha_pattern": [None, {}],
    "modules_to_save": [None, []],
    "layer_replication": [None, []],
}


def peft_adapter_config(tmp_path) -> dict:
    """The adapter_config.json peft itself writes for a plain LoRA (r 4, alpha 8)."""
    from peft import LoraConfig

    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]).save_pretrained(str(tmp_path / "peft"))
    return json.loads((tmp_path / "peft" / "adapter_config.json").read_text())


def write_adapter_config(folder: Path, config: dict) -> Path:
    path = folder / "adapter_config.json"
    # NaN and Infinity as json writes (and reads) them
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("key", sorted(BAD_ADAPTER_VALUES))
def test_adapter_config_values_that_cannot_merge_are_refused(key, tmp_path):
    from fsdp_recipes.ckpt.lora_merge import read_adapter_config
    from fsdp_recipes.errors import CheckpointError

    valid = peft_adapter_config(tmp_path)
    assert read_adapter_config(write_adapter_config(tmp_path, valid))["r"] == 4
    for value in BAD_ADAPTER_VALUES[key]:
        path = write_adapter_config(tmp_path, {**valid, key: value})
        with pytest.raises(CheckpointError) as err:
            read_adapter_config(path)
        message = str(err.value)
        assert message.startswith(f"{path}: {key} ") and "\n" not in message, (value, message)


@pytest.mark.parametrize("key", sorted(GOOD_ADAPTER_VALUES))
def test_adapter_config_values_peft_writes_are_taken(key, tmp_path):
    from fsdp_recipes.ckpt.lora_merge import read_adapter_config

    valid = peft_adapter_config(tmp_path)
    for value in GOOD_ADAPTER_VALUES[key]:
        assert read_adapter_config(write_adapter_config(tmp_path, {**valid, key: value}))[key] == value


@pytest.mark.parametrize("missing", [["r"], ["lora_alpha"], ["lora_alpha", "r"]])
def test_an_adapter_config_without_r_or_alpha(missing, tmp_path):
    from fsdp_recipes.ckpt.lora_merge import read_adapter_config
    from fsdp_recipes.errors import CheckpointError

    config = {k: v for k, v in peft_adapter_config(tmp_path).items() if k not in missing}
    with pytest.raises(CheckpointError, match=f"is not a LoRA adapter config \\(no {' and no '.join(missing)}\\)"):
        read_adapter_config(write_adapter_config(tmp_path, config))


class FakeSource:
    """A checkpoint source holding one LoRA-wrapped linear (out 3, in 5) of rank ``r``."""

    def __init__(self, r: int, scale: float = 1.0):
        import torch

        from fsdp_recipes.ckpt.readers import TensorInfo

        gen = torch.Generator().manual_seed(r)
        self.values = {
            "q.base_layer.weight": torch.randn(3, 5, generator=gen),
            "q.lora_A.default.weight": torch.randn(r, 5, generator=gen) * scale,
            "q.lora_B.default.weight": torch.randn(3, r, generator=gen) * scale,
            "norm.weight": torch.ones(5),
        }
        self.tensors = {n: TensorInfo(tuple(t.shape), "float32") for n, t in self.values.items()}
        self.ranks, self.kind = 1, "fake"

    def read(self, names):
        return {n: self.values[n] for n in names}


@pytest.mark.parametrize("rank", [1, 4])
def test_a_config_whose_r_is_not_the_adapters_is_refused(rank):
    import torch

    from fsdp_recipes.ckpt.lora_merge import MergedLoraSource
    from fsdp_recipes.errors import CheckpointError

    source = FakeSource(rank)
    config = {"r": rank, "lora_alpha": 8}
    merged = MergedLoraSource(source, config).read(["q.weight"])["q.weight"]
    v = source.values
    torch.testing.assert_close(
        merged, v["q.base_layer.weight"] + v["q.lora_B.default.weight"] @ v["q.lora_A.default.weight"] * (8 / rank)
    )
    for other in (rank + 1, 65536):
        with pytest.raises(
            CheckpointError, match=f"q.lora_A.default.weight has rank {rank} but adapter_config.json says r {other}"
        ):
            MergedLoraSource(source, {"r": other, "lora_alpha": 8})
    # per-module ranks: peft's own
    MergedLoraSource(source, {"r": rank + 1, "lora_alpha": 8, "rank_pattern": {"q": rank}})


def test_a_merge_that_overflows_is_refused_not_written():
    from fsdp_recipes.ckpt.lora_merge import MergedLoraSource
    from fsdp_recipes.errors import CheckpointError

    # B @ A about 1e40: beyond float32
    source = FakeSource(2, scale=1e20)
    with pytest.raises(
        CheckpointError,
        match=r"^q.weight: merging lora_B @ lora_A x 4 into it gives values that are not finite in float32",
    ):
        MergedLoraSource(source, {"r": 2, "lora_alpha": 8}).read(["q.weight"])
    source = FakeSource(2)
    # the checkpoint's own NaN: passed on as stored, not blamed on the merge
    source.values["q.base_layer.weight"][0, 0] = float("nan")
    merged = MergedLoraSource(source, {"r": 2, "lora_alpha": 8}).read(["q.weight"])["q.weight"]
    assert merged[0, 0].isnan() and merged.isfinite().sum() == merged.numel() - 1


def test_the_config_peft_writes_still_merges_as_merge_and_unload(tmp_path):
    """The checks take peft's own file: a peft model's whole state dict merges bit for bit as peft merges it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.ckpt.lora_merge import MergedLoraSource, read_adapter_config
    from fsdp_recipes.ckpt.readers import TensorInfo

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_rslora=True
    )
    model = get_peft_model(
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")), config
    )
    model.peft_config["default"].save_pretrained(str(tmp_path))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    source = FakeSource(1)
    source.values, source.tensors = state, {k: TensorInfo(tuple(v.shape), "float32") for k, v in state.items()}
    merged = MergedLoraSource(source, read_adapter_config(tmp_path / "adapter_config.json"))
    ours = merged.read(sorted(merged.tensors))
    by_peft = model.merge_and_unload().state_dict()
    assert len(by_peft) == len(ours) and all(torch.equal(ours[f"base_model.model.{k}"], v) for k, v in by_peft.items())
