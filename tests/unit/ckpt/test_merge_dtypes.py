"""A merged model is written in the dtypes its header states, whatever dtypes the checkpoint mixes: a LoRA adapter
trained in fp32 over a bf16 or fp16 base (bf16 mixed precision upcasts the trainable weights) merges as peft's
merge_and_unload does, in the base's dtype; the writer casts every tensor a source gives to its stated dtype and
refuses one of another shape, so no tensor's bytes can run into the next one's place (a bf16 LoRA run's final
model was garbage: fp32 sums written into bf16 slots)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from fsdp_recipes.ckpt.readers import TensorInfo
from fsdp_recipes.ckpt.safetensors_writer import write_weights
from fsdp_recipes.errors import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("adapter_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16", "float16"])
def test_an_adapter_merges_in_the_base_dtype_as_peft_merges_it(tmp_path, base_dtype, adapter_dtype):
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    base_dir, ckpt = tmp_path / "base", tmp_path / "run" / "checkpoint-2"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")).to(
        DTYPES[base_dtype]
    ).save_pretrained(base_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=DTYPES[base_dtype]),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
        autocast_adapter_dtype=False,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                # trained, in its dtype
                param.data = torch.randn_like(param, dtype=torch.float32).to(DTYPES[adapter_dtype])
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert {t.dtype for t in adapter.values()} == {DTYPES[adapter_dtype]}
    dcp.save({"model": adapter}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    model.peft_config["default"].save_pretrained(str(ckpt))
    # peft's own merge of the same tensors
    by_peft = model.merge_and_unload().state_dict()

    merge_checkpoint(ckpt, tmp_path / "merged", base_model=str(base_dir), log=lambda line: None)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for key, expected in by_peft.items():
        if key == "lm_head.weight" and key not in merged:
            # tied: written once, as save_pretrained does
            continue
        assert merged[key].dtype == DTYPES[base_dtype], key
        assert torch.equal(merged[key], expected), key


class Source:
    """A checkpoint source whose read gives other dtypes or shapes than its metadata states."""

    def __init__(self, tensors: dict[str, torch.Tensor], stated: dict[str, TensorInfo]):
        self._tensors, self.tensors = tensors, stated

    def read(self, names):
        return {n: self._tensors[n] for n in names}


def test_the_writer_casts_to_the_stated_dtype_and_refuses_another_shape(tmp_path):
    a, b = torch.randn(4, 3), torch.randn(5)
    stated = {"a": TensorInfo((4, 3), "bfloat16"), "b": TensorInfo((5,), "bfloat16")}
    # fp32 given where bf16 is stated
    write_weights(Source({"a": a, "b": b}, stated), ["a", "b"], tmp_path)
    out = load_file(tmp_path / "model.safetensors")
    assert torch.equal(out["a"], a.to(torch.bfloat16)) and torch.equal(out["b"], b.to(torch.bfloat16))

    (tmp_path / "bad").mkdir()
    with pytest.raises(
        CheckpointError, match=r"a: the checkpoint gave a tensor of shape \(3, 4\), where its metadata states \(4, 3\)"
    ):
        write_weights(Source({"a": a.T.contiguous(), "b": b}, stated), ["a", "b"], tmp_path / "bad")


# (saved dtype, --dtype, a value the saved dtype holds and --dtype cannot, the dtypes whose range holds it)
OUT_OF_RANGE = [
    ("float32", "float16", 65520.0, "bfloat16 or float32"),
    ("float32", "float16", -1e5, "bfloat16 or float32"),
    ("bfloat16", "float16", 1e30, "bfloat16 or float32"),
    ("float32", "float16", 3e38, "bfloat16 or float32"),
    ("float32", "bfloat16", 3.4e38, "float32"),
    ("float64", "bfloat16", 1e100, "float32"),
]


@pytest.mark.parametrize("saved, requested, value, wider", OUT_OF_RANGE)
def test_finite_weights_out_of_the_requested_dtypes_range_are_said_so(tmp_path, saved, requested, value, wider):
    """Finite weights that --dtype cannot hold are not called NaN (a diverged run): the line names the range and the
    --dtype that holds them."""
    weight = torch.randn(8, 4, dtype=torch.float64).to(getattr(torch, saved))
    weight[3, 1] = value
    stated = {"w": TensorInfo((8, 4), saved)}
    with pytest.raises(CheckpointError) as err:
        write_weights(Source({"w": weight}, stated), ["w"], tmp_path, dtype=requested)
    line = str(err.value)
    assert "\n" not in line and "NaN" not in line and "diverged" not in line, line
    assert f"exceed {requested}'s range" in line and f"--dtype {wider}" in line, line
    assert f"leave --dtype out to keep {saved}" in line, line


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_weights_that_are_not_finite_before_the_cast_are_still_called_so(tmp_path, bad):
    weight = torch.randn(8, 4)
    weight[0, 0] = bad
    with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
        write_weights(Source({"w": weight}, {"w": TensorInfo((8, 4), "float32")}), ["w"], tmp_path, dtype="float16")
