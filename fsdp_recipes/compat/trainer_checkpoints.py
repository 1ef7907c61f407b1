"""The one patch of the Trainer's checkpointing: LoRA checkpoints under FSDP hold the whole model.

For a peft model under FSDP the Trainer asks accelerate for adapter-only checkpoints ({"adapter_only": True}, from
``transformers.trainer.get_fsdp_ckpt_kwargs``); accelerate 1.15's come out empty under FSDP1. Within
``whole_model_fsdp_checkpoints`` the Trainer asks for the whole model instead (no arguments), which resumes exactly.
"""

from __future__ import annotations

from contextlib import contextmanager

from fsdp_recipes.compat import internals

_ASK = "transformers.trainer.get_fsdp_ckpt_kwargs"


@contextmanager
def whole_model_fsdp_checkpoints():
    ask = internals.patch(_ASK, dict)  # dict(): no keyword arguments, the whole model
    try:
        yield
    finally:
        internals.patch(_ASK, ask)
