"""A resume never rounds a checkpoint's tensors: each weight the checkpoint stores, and for a LoRA checkpoint the
frozen base its run loaded in the dtype its config.json records, against the dtype the resumed run declares it holds
each parameter in (--dtype, peft's fp32 adapter, FSDP mixed precision's fp32 master weights). Generated over every
saved dtype x requested dtype x full fine-tuning or LoRA x mixed precision on or off, on the tiny model as the run
builds it, and checkpoints written by torch's DCP as accelerate writes them."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import REPO

from fsdp_recipes.ckpt.dtype_match import dtype_mismatch, narrowed, rounds

TINY = REPO / "assets" / "tiny-llama"
DTYPES = ["float64", "float32", "bfloat16", "float16"]
HALF = {"bfloat16", "float16"}
# the checkpoints here are written by one process, as DCP's no_dist=True says it assumes
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def rounded(saved: str, held: str) -> bool:
    """What a cast does, written out: exact into the same dtype or a wider float, rounding otherwise."""
    wider = {"float64": set(), "float32": {"float64"}, "bfloat16": {"float32", "float64"}}
    wider["float16"] = wider["bfloat16"]
    return saved != held and held not in wider[saved]


@functools.cache
def built(requested: str, lora: bool):
    """The tiny model as load_model builds it at --dtype ``requested`` (with add_lora's adapter for LoRA)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.config.model_arguments import ModelArguments
    from fsdp_recipes.train.modeling import add_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), dtype=getattr(torch, requested))
    return add_lora(model, ModelArguments(config_name=str(TINY), use_peft=True, lora_r=4)) if lora else model


@functools.cache
def checkpoint(root, saved: str, lora: bool, base: object = "same"):
    """A checkpoint of the model's trained weights stored in ``saved`` (accelerate's {"model": state_dict} in DCP)
    and config.json recording the base's dtype (``base``: "same" for ``saved``, anything else written as is, absent
    when None)."""
    import torch.distributed.checkpoint as dcp

    ckpt = root / f"{saved}-{'lora' if lora else 'full'}-{base}"
    model = built("float32", lora)
    state = {
        name: torch.zeros(p.shape, dtype=getattr(torch, saved))
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    dcp.save({"model": state}, checkpoint_id=ckpt / "pytorch_model_fsdp_0", no_dist=True)
    config = json.loads((TINY / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if base is not None:
        config["dtype"] = saved if base == "same" else base
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("resume-dtypes")


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32-or-dtype", "fsdp-mixed-precision"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("requested", DTYPES)
@pytest.mark.parametrize("saved", DTYPES)
def test_a_resume_that_would_round_a_weight_or_the_lora_base_is_refused(root, saved, requested, lora, mixed_precision):
    from fsdp_recipes.train.optimizer import held_dtypes

    # what the resumed run holds: its trained weights in fp32 under FSDP mixed precision (accelerate upcasts them),
    # else at --dtype, a LoRA adapter over a 16-bit base in fp32 (peft); a LoRA run's frozen base at --dtype
    trained = "float32" if mixed_precision or (lora and requested in HALF) else requested
    weights_rounded = rounded(saved, trained)
    base_rounded = lora and rounded(saved, requested)

    said = dtype_mismatch(checkpoint(root, saved, lora), *held_dtypes(built(requested, lora), mixed_precision))

    if not (weights_rounded or base_rounded):
        assert said is None, said
        return
    assert said is not None and "\n" not in said and f"resume with --dtype {saved}" in said, said
    if weights_rounded and not base_rounded:
        assert f"holds {saved} weights and this run's parameters are {trained}" in said, said
    if base_rounded and not weights_rounded:
        assert f"trained on its base model's weights in {saved}" in said and f"loads them in {requested}" in said


@pytest.mark.parametrize("base", [None, 3, "float8_e4m3fn", "int8", "../float32", "auto"])
def test_a_lora_base_dtype_not_recorded_as_a_float_is_not_compared(root, base):
    """config.json without a float dtype (another tool's checkpoint, a hostile value) neither refuses nor breaks the
    check: only the stored adapter is compared (here fp32, as peft holds it: nothing rounds)."""
    from fsdp_recipes.train.optimizer import held_dtypes

    ckpt = checkpoint(root, "float32", True, base)
    assert dtype_mismatch(ckpt, *held_dtypes(built("bfloat16", True), False)) is None


def test_the_verdict_is_the_casts():
    """The decision itself: every stored weight against its held dtype, the frozen ones the checkpoint lacks against
    the recorded base dtype, nothing else (integer step counts, 4-bit storage, trained weights it lacks)."""
    for saved in DTYPES:
        for held in DTYPES:
            assert rounds(saved, held) == rounded(saved, held), (saved, held)
    assert not rounds("int64", "float32") and not rounds("float32", "uint8") and not rounds(None, "bfloat16")
    held = {"a": "bfloat16", "b": "bfloat16", "c": "uint8"}
    assert narrowed({}, held, {"a", "b", "c"}, "float32") == ("a", "float32", "bfloat16")
    assert narrowed({}, held, set(), "float32") is None  # trained weights a checkpoint lacks: model_mismatch's
    assert narrowed({"a": "bfloat16"}, held, {"a", "c"}, "float32") is None  # stored beats recorded
    assert narrowed({"b": "float32"}, held, set(), None) == ("b", "float32", "bfloat16")
