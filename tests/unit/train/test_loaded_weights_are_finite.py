"""A model loaded for training holds finite weights, or the run stops before the first step in one line naming the
tensor: NaN or Inf bytes in a file trained into NaN losses and were saved as a model of NaNs without a word.
Generated over the value (NaN, +Inf, -Inf), where it sits (the first weight, a middle one, the last, a norm, one
element or a whole tensor) and the dtype it is loaded in; float16's overflow of a finite file names the fix."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import REPO, rewrite_weights

from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.modeling import load_model, load_tokenizer

TINY = REPO / "assets" / "tiny-llama"
WHERE = [
    "model.embed_tokens.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.3.input_layernorm.weight",
    "lm_head.weight",
]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The tiny Llama saved as a model folder of finite fp32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("finite") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)).save_pretrained(folder)
    return folder


def load(folder, dtype):
    args = ModelArguments(model_name_or_path=str(folder), tokenizer_name=str(TINY), dtype=dtype)
    return load_model(args, load_tokenizer(args))


def poisoned(clean, tmp_path, name, value, whole) -> tuple:
    """A copy of ``clean`` with ``value`` written into ``name`` (every element, or the middle one): (folder, how
    many values were written)."""
    folder = tmp_path / "model"
    shutil.copytree(clean, folder)
    written = []

    def edit(tensors):
        if whole:
            tensors[name].fill_(value)
        else:
            tensors[name].view(-1)[tensors[name].numel() // 2] = value
        written.append(tensors[name].numel() if whole else 1)

    rewrite_weights(folder, edit)
    return folder, written[0]


CASES = [
    pytest.param(name, value, False, dtype, id=f"{name}-{label}-{dtype}")
    for name in WHERE
    for value, label in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"))
    for dtype in ("float32", "bfloat16")
] + [pytest.param(name, float("nan"), True, "bfloat16", id=f"{name}-whole-tensor") for name in WHERE]


@pytest.mark.parametrize(("name", "value", "whole", "dtype"), CASES)
def test_a_non_finite_weight_stops_the_load_naming_the_tensor(clean, tmp_path, name, value, whole, dtype):
    folder, count = poisoned(clean, tmp_path, name, value, whole)
    with pytest.raises(RecipeError) as err:
        load(folder, dtype)
    said = str(err.value)
    assert "\n" not in said, said
    assert f"has {count} non-finite value(s) (NaN or Inf) in {name} as loaded ({dtype})" in said, said


def test_finite_weights_load_and_float16_overflow_names_the_fix(clean, tmp_path):
    """The clean file loads in every dtype; a finite value past float16's range loads in float32 and bfloat16, and
    is refused as float16 (where it becomes Inf) with the dtype to use instead."""
    for dtype in ("float32", "bfloat16", "float16"):
        assert load(clean, dtype) is not None
    folder, _ = poisoned(clean, tmp_path, "model.layers.0.mlp.up_proj.weight", 1e6, False)
    for dtype in ("float32", "bfloat16"):
        assert load(folder, dtype) is not None
    with pytest.raises(RecipeError, match=r"up_proj.weight as loaded \(float16\) \(--dtype float16 turns values"):
        load(folder, "float16")
