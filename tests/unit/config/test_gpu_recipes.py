"""The shipped GPU recipes that train every weight name the fused AdamW, which FSDP2 can step; the tiny CPU recipes
keep transformers' default."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO
from transformers.training_args import OptimizerNames

from fsdp_recipes.config.recipe_checks import unsteppable_optimizer

RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(REPO / "recipes").as_posix())
def test_full_training_on_gpus_names_the_fused_adamw(path):
    recipe = yaml.safe_load(path.read_text())
    on_cpu = path.parent.name.startswith("tiny-")
    full = not recipe.get("use_peft")
    if on_cpu or not full:  # a LoRA adapter's step is a sliver of the run: nothing to gain by naming it
        assert "optim" not in recipe
        return
    assert recipe["optim"] == "adamw_torch_fused" and unsteppable_optimizer(recipe["optim"]) is None
    assert OptimizerNames(recipe["optim"]) is OptimizerNames.ADAMW_TORCH_FUSED  # a name transformers takes
