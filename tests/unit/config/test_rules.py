"""An argument dataclass built directly (as tools and tests build them, without the parser) refuses what its fields
declare they do not take, in one line naming the field: rules.check in each __post_init__."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import REPO

from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.config.run_arguments import RunArguments
from fsdp_recipes.errors import RecipeError

# the least each dataclass needs to be built
VALID = {
    ModelArguments: {"config_name": str(REPO / "assets" / "tiny-llama")},
    DataArguments: {"train_file": str(REPO / "assets" / "data" / "tiny_corpus.txt")},
    RunArguments: {},
}

CHOICE_CASES = [
    (cls, f.name, value)
    for cls in VALID
    for f in dataclasses.fields(cls)
    if f.metadata.get("choices")
    for value in ("not-a-choice", 5, *([None] if f.default is not None else []))
]

RANGE_CASES = [(cls, name, value) for cls in VALID for name in cls.RULES for value in (-1, float("nan"), "12")]


def test_the_cases_cover_every_declared_field():
    assert {name for _, name, _ in CHOICE_CASES} >= {"dtype", "data_format", "save_dtype", "async_checkpoint_staging"}
    assert {name for _, name, _ in RANGE_CASES} >= {"block_size", "lora_r", "peak_tflops"}


@pytest.mark.parametrize("cls, name, value", CHOICE_CASES + RANGE_CASES)
def test_a_value_a_field_does_not_take_is_one_line_naming_it(cls, name, value):
    with pytest.raises(RecipeError) as err:
        cls(**VALID[cls], **{name: value})
    assert str(err.value).startswith(f"{name}=") and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("cls", VALID)
def test_the_defaults_and_trls_packing_words_pass(cls):
    cls(**VALID[cls])
    if cls is DataArguments:
        # TRL's bool, as YAML gives it, and our words
        for packing in (True, False, "true", "concat"):
            cls(**VALID[cls], packing=packing)
