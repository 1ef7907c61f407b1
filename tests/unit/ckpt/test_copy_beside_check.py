"""A merge of another tool's checkpoint (no manifest) copies the weights while transformers checks config.json
against them, never after: that check costs seconds of imports whatever the model's size, so waiting for it first
put those seconds before every byte of the copy. The copy starts on the weights guessed from the stored names and
the config's tie (namespace.guess_weights); the check still has the last word, and a wrong guess is copied again.

Each case stores a tiny model's whole state dict (both embeddings, tied or not) as one safetensors file, as
``dcp.save(model.state_dict())`` or a bare ``save_file`` leave it, with the config beside it or given by --base-model.
The check is held until the copy has begun: a merge that waits for the check before copying fails in WAIT seconds.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fsdp_recipes.ckpt import merge

# seconds the check waits for the copy to begin; the copy begins milliseconds after the check starts
WAIT = 15

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2, "n_head": 2}

# case -> (config.json's settings, where the config comes from, whether the stored state dict has lm_head.weight,
# copies made: a guess from the config's own tie is right; an architecture's default tie is not known without
# transformers, and a wrong guess is copied again)
CASES = {
    "config beside, tied": ({**LLAMA, "tie_word_embeddings": True}, "beside", True, 1),
    "config beside, tied, head left out": ({**LLAMA, "tie_word_embeddings": True}, "beside", False, 1),
    "config beside, untied by the architecture's default": (LLAMA, "beside", True, 1),
    "config beside, tied by the architecture's default": ({**GPT2, "vocab_size": 128}, "beside", True, 2),
    "--base-model, tied": ({**LLAMA, "tie_word_embeddings": True}, "base", True, 1),
    "--base-model, untied": ({**LLAMA, "tie_word_embeddings": False}, "base", True, 1),
}


def _checkpoint(root: Path, settings: dict, where: str, with_head: bool) -> tuple[Path, Path | None, dict]:
    """(checkpoint folder, --base-model folder or None, the weights from_pretrained expects: save_pretrained's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (root / "config").mkdir(parents=True)
    (root / "config" / "config.json").write_text(json.dumps(settings))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "config"))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if not with_head:
        state.pop("lm_head.weight")
    ckpt = root / "checkpoint"
    ckpt.mkdir()
    save_file(state, str(ckpt / "model.safetensors"))
    model.save_pretrained(root / "truth")
    with safe_open(str(root / "truth" / "model.safetensors"), framework="pt") as f:
        truth = {k: f.get_tensor(k) for k in f.keys()}
    if where == "beside":
        (ckpt / "config.json").write_text(json.dumps(settings))
        return ckpt, None, truth
    return ckpt, root / "config", truth


@pytest.mark.parametrize("case", list(CASES))
def test_a_foreign_checkpoint_is_copied_while_transformers_checks_it(case, tmp_path, monkeypatch):
    settings, where, with_head, copied = CASES[case]
    ckpt, base, truth = _checkpoint(tmp_path, settings, where, with_head)
    copying, copies = threading.Event(), []
    write_weights, describe = merge.write_weights, merge.describe_with_transformers

    def write(source, names, *args, **kwargs):
        copies.append(sorted(names))
        copying.set()
        return write_weights(source, names, *args, **kwargs)

    def check(*args, **kwargs):
        if not copying.wait(WAIT):
            raise AssertionError(f"the copy did not begin within {WAIT} s of the check: it waited for the check")
        return describe(*args, **kwargs)

    monkeypatch.setattr(merge, "write_weights", write)
    monkeypatch.setattr(merge, "describe_with_transformers", check)
    out = tmp_path / "merged"
    merge.merge_checkpoint(ckpt, out, base_model=None if base is None else str(base), log=lambda *_: None)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(got) == sorted(truth), case
    assert all(torch.equal(got[k], truth[k]) for k in truth), case
    # the checked weights, whatever was guessed
    assert copies[-1] == sorted(truth) and len(copies) == copied, copies
