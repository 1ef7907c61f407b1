"""The shipped GPU recipes that train every weight name the fused AdamW, which FSDP2 can step, and turn on Liger's
kernels where Liger has them for the model (Llama; not GPT-2), pinned in requirements-gpu.txt; the tiny CPU recipes
keep transformers' defaults."""

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
    # a LoRA adapter's step is a sliver of the run: nothing to gain by naming it
    if on_cpu or not full:
        assert "optim" not in recipe
        return
    assert recipe["optim"] == "adamw_torch_fused" and unsteppable_optimizer(recipe["optim"]) is None
    # a name transformers takes
    assert OptimizerNames(recipe["optim"]) is OptimizerNames.ADAMW_TORCH_FUSED


# Liger patches these model families (liger_kernel.transformers.monkey_patch); GPT-2 is not among them
LIGER_FAMILIES = ("llama",)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(REPO / "recipes").as_posix())
def test_full_training_of_a_liger_family_on_gpus_turns_liger_on(path):
    recipe = yaml.safe_load(path.read_text())
    gpu_full = not path.parent.name.startswith("tiny-") and not recipe.get("use_peft")
    liger = gpu_full and path.parent.name.startswith(LIGER_FAMILIES)
    assert recipe.get("use_liger_kernel", False) is liger


def test_the_gpu_requirements_pin_the_liger_the_gpu_check_measured():
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements-gpu.txt").read_text().splitlines()]
    assert [line for line in lines if line] == [f"liger-kernel=={gpu_check.CARRY['liger_kernel']}"]
