"""The one patch of the Trainer's checkpointing: adapter-only LoRA checkpoints under FSDP that hold every rank's slice.

For a peft model under FSDP the Trainer asks accelerate for adapter-only checkpoints ({"adapter_only": True}, from
``transformers.trainer.get_fsdp_ckpt_kwargs``). accelerate 1.15 selects the adapter with peft's
``get_peft_model_state_dict``, and peft 0.21 picks the adapter's entries by module names from ``named_modules()``,
from which it strips only a leading ``_fsdp_wrapped_module.``: under FSDP1 every wrapped decoder layer puts another
one in the middle of the name (``..._fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module.
self_attn.q_proj``), as activation checkpointing puts ``_checkpoint_wrapped_module.`` under FSDP2 too, while the
state dict's keys are clean. No name matches, the selection is empty, and every rank writes a 0-byte shard: the
resume then loads nothing (measured: transformers 5.23, accelerate 1.15, peft 0.21.2, torch 2.13, FSDP1
SHARDED_STATE_DICT).

Within ``adapter_only_fsdp_checkpoints`` accelerate's adapter-only state dict is torch's own selection instead:
``get_model_state_dict(..., ignore_frozen_params=True)`` (the parameters that train, by their clean names, sharded
as FSDP1 ShardedTensors or FSDP2 DTensors: every rank writes its own slice) and, to load, ``set_model_state_dict``
with ``strict=False`` (the frozen base is the model source's, unchanged). DCP refuses a checkpoint lacking any of
these keys, so nothing trains on from a fresh adapter silently. Names keep peft's adapter name (``lora_A.default``):
the same names as a whole-model checkpoint's, which the merge reads (fsdp_recipes.ckpt.lora_merge).

FSDP2 FULL_STATE_DICT runs use the same selection (torch gathers every rank's rows of each trained tensor: the
bug accelerate PR #4206 fixed, which kept rank 0's, cannot occur; tests/integration/test_lora.py resumes such a
checkpoint to the
same bits). FSDP1 FULL_STATE_DICT runs keep whole-model checkpoints (``whole_model_fsdp_checkpoints``); train_fsdp.py
refuses to resume them anyway with use_orig_params, which FSDP1 LoRA needs (FSDPTrainer.inexact_full_resume).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from fsdp_recipes.compat import internals

_ASK = "transformers.trainer.get_fsdp_ckpt_kwargs"
_GET = "accelerate.utils.fsdp_utils._get_model_state_dict"
_SET = "accelerate.utils.fsdp_utils._set_model_state_dict"


@contextmanager
def whole_model_fsdp_checkpoints():
    # dict(): no keyword arguments, the whole model
    ask = internals.patch(_ASK, dict)
    try:
        yield
    finally:
        internals.patch(_ASK, ask)


def _options(sd_options, **changes):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # None: FSDP1, sharded
    return replace(sd_options, **changes) if sd_options is not None else StateDictOptions(**changes)


# as fsdp_recipes.ckpt.layout's
_WRAPPERS = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def _frozen_names(model) -> set[str]:
    """Every name of every frozen parameter, a shared one's included, as the state dict names them (no wrappers)."""
    names = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            for wrapper in _WRAPPERS:
                name = name.replace(wrapper, "")
            names.add(name)
    return names


@contextmanager
def adapter_only_fsdp_checkpoints():
    get, put = internals.get(_GET), internals.get(_SET)

    def trained_state_dict(model, adapter_only=False, sd_options=None):
        if not adapter_only:
            return get(model, adapter_only, sd_options)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=_options(sd_options, ignore_frozen_params=True))
        # torch drops a frozen weight under its first name only: a tied one (lm_head.weight = embed_tokens.weight)
        # stayed under the other, and the checkpoint was then neither adapter-only nor whole (the merge refused it)
        for name in _frozen_names(model) & set(state):
            del state[name]
        return state

    def set_trained_state_dict(model, state_dict, adapter_only=False, sd_options=None):
        if not adapter_only:
            return put(model, state_dict, adapter_only, sd_options)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        return set_model_state_dict(
            model, state_dict, options=_options(sd_options, ignore_frozen_params=True, strict=False)
        )

    internals.patch(_GET, trained_state_dict)
    internals.patch(_SET, set_trained_state_dict)
    try:
        yield
    finally:
        internals.patch(_GET, get)
        internals.patch(_SET, put)
