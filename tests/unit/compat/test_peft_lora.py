"""peft 0.21.2 reads transformers 5.23's deprecated ``is_gradient_checkpointing`` when it wraps a model: the
FutureWarning it caused in every LoRA run is filtered around that call (fsdp_recipes/compat/peft_lora.py), and
only there."""

from __future__ import annotations

import warnings

from conftest import REPO
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.train.modeling import add_lora

ALIAS = "`is_gradient_checkpointing` is deprecated"


def tiny_model():
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))


def alias_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        # not just once per place: every warning the call raises
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and ALIAS in str(w.message)]


def test_peft_itself_still_warns():
    """The cause, unfiltered: when peft stops reading the alias this fails, and compat/peft_lora.py can go."""
    from peft import LoraConfig, get_peft_model

    _, seen = alias_warnings(
        lambda: get_peft_model(tiny_model(), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    )
    assert seen, "peft no longer reads is_gradient_checkpointing: drop fsdp_recipes/compat/peft_lora.py"


def test_lora_model_is_built_without_the_warning():
    args = ModelArguments(config_name=str(REPO / "assets" / "tiny-llama"), use_peft=True, lora_r=4)
    model, seen = alias_warnings(lambda: add_lora(tiny_model(), args))
    assert seen == []
    assert type(model).__name__ == "PeftModelForCausalLM" and any("lora_A" in n for n, _ in model.named_parameters())


def test_the_filter_ends_with_the_call():
    """Exactly that warning, around that call: the alias read anywhere else still warns."""
    args = ModelArguments(config_name=str(REPO / "assets" / "tiny-llama"), use_peft=True, lora_r=4)
    add_lora(tiny_model(), args)
    _, seen = alias_warnings(lambda: tiny_model().is_gradient_checkpointing)
    assert len(seen) == 1
