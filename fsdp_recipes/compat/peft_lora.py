"""peft's ``get_peft_model`` without transformers' FutureWarning about ``is_gradient_checkpointing``.

peft 0.21.2 reads ``model.is_gradient_checkpointing`` when it wraps a model (``PeftModel.__init__``); transformers
5.23 made that property a deprecated alias of ``is_activation_checkpointing`` that warns on every read. The
warning was printed once per process in every LoRA run and names nothing the user can change, so exactly that
warning is ignored around this one call; any other warning, and this one anywhere else, still shows. Drop this
module once peft reads ``is_activation_checkpointing`` (tests/unit/compat/test_peft_lora.py says when peft stops
warning).
"""

from __future__ import annotations

import warnings

# transformers 5.23, modeling_utils.py
CHECKPOINTING_ALIAS = r"`is_gradient_checkpointing` is deprecated"


def get_peft_model(model, config):
    """peft.get_peft_model(model, config), with transformers' deprecation warning for peft's read filtered."""
    from peft import get_peft_model as wrap

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CHECKPOINTING_ALIAS, category=FutureWarning)
        return wrap(model, config)
