"""A resume never rounds a checkpoint's tensors: each weight the checkpoint stores, and for a LoRA checkpoint the
frozen base its run loaded in the dtype its config.json records, against the dtype the resumed run declares it holds
each parameter in (--dtype, peft's fp32 adapter, FSDP mixed precision's fp32 master weights). Generated over every
saved dtype x requested dtype x full fine-tuning or LoRA x mixed precision on or off, on the tiny model as the run
builds it, and checkpoints written by torch's DCP as accelerate writes them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

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
    # trained weights a checkpoint lacks: model_mismatch's
    assert narrowed({}, held, set(), "float32") is None
    # stored beats recorded
    assert narrowed({"a": "bfloat16"}, held, {"a", "c"}, "float32") is None
    assert narrowed({"b": "float32"}, held, set(), None) == ("b", "float32", "bfloat16")


def lora_checkpoint_elsewhere(root, tmp_path, config_dtype) -> Path:
    """The fp32 LoRA checkpoint copied to output_dir/checkpoint-1 under ``tmp_path``, its config.json's dtype
    ``config_dtype`` (absent when None)."""
    import shutil

    ckpt = tmp_path / "out" / "checkpoint-1"
    shutil.copytree(checkpoint(root, "float32", True, config_dtype), ckpt)
    return ckpt


def base_folder(tmp_path, dtype) -> Path:
    """A base model folder whose config.json records ``dtype`` (absent when None)."""
    folder = tmp_path / "base"
    folder.mkdir(exist_ok=True)
    config = json.loads((TINY / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if dtype is not None:
        config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_record(ckpt, model: object) -> None:
    (ckpt.parent / "run_args.json").write_text(json.dumps({"model": model}))


def adapter_names(ckpt, base) -> None:
    (ckpt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(base)}))


# where else a run records the dtype its LoRA base was loaded in, when the checkpoint's config.json does not
RECORDS = {
    "run-args-dtype": lambda ckpt, base: run_record(ckpt, {"dtype": "float32", "model_name_or_path": "x"}),
    "run-args-auto-base-config": lambda ckpt, base: run_record(
        ckpt, {"dtype": "auto", "model_name_or_path": str(base)}
    ),
    "adapter-config-base": lambda ckpt, base: adapter_names(ckpt, base),
    "run-args-auto-adapter-base": lambda ckpt, base: (run_record(ckpt, {"dtype": "auto"}), adapter_names(ckpt, base)),
}


@pytest.mark.parametrize("recorded", RECORDS)
@pytest.mark.parametrize("config_dtype", [None, 3, "auto", "int8", ("float32",)])
def test_a_lora_base_dtype_the_checkpoint_lacks_is_taken_from_its_run(root, tmp_path, config_dtype, recorded):
    """A LoRA checkpoint whose config.json records no float dtype (removed, or a hostile value) is compared against
    what else its run recorded: run_args.json's --dtype beside it, else the config.json of the base model the run or
    the checkpoint's adapter_config.json names. An fp32 base resumed in bf16 is refused, naming where fp32 was read."""
    from fsdp_recipes.train.optimizer import held_dtypes

    ckpt = lora_checkpoint_elsewhere(root, tmp_path, config_dtype)
    RECORDS[recorded](ckpt, base_folder(tmp_path, "float32"))

    said = dtype_mismatch(ckpt, *held_dtypes(built("bfloat16", True), False))

    assert said is not None and "\n" not in said, said
    assert "trained on its base model's weights in float32" in said and "resume with --dtype float32" in said, said
    where = "run_args.json" if recorded == "run-args-dtype" else "base model's config.json"
    assert where in said, said
    # resumed in the recorded dtype: nothing rounds
    assert dtype_mismatch(ckpt, *held_dtypes(built("float32", True), False)) is None


UNRECORDED = {
    "no-records": lambda ckpt, base: None,
    "run-args-a-list": lambda ckpt, base: (ckpt.parent / "run_args.json").write_text("[]"),
    "run-args-cut-short": lambda ckpt, base: (ckpt.parent / "run_args.json").write_text('{"model": {"dty'),
    "run-args-a-folder": lambda ckpt, base: (ckpt.parent / "run_args.json").mkdir(),
    "model-a-number": lambda ckpt, base: run_record(ckpt, 3),
    "dtype-a-path": lambda ckpt, base: run_record(ckpt, {"dtype": "../float32"}),
    "dtype-a-list": lambda ckpt, base: run_record(ckpt, {"dtype": ["float32"], "model_name_or_path": str(base)}),
    "auto-base-missing": lambda ckpt, base: run_record(ckpt, {"dtype": "auto", "model_name_or_path": "/no/such"}),
    "auto-base-nul": lambda ckpt, base: run_record(ckpt, {"dtype": "auto", "model_name_or_path": "a\0b"}),
    "auto-base-a-number": lambda ckpt, base: run_record(ckpt, {"dtype": "auto", "model_name_or_path": 7}),
    "adapter-base-not-a-hub-id": lambda ckpt, base: adapter_names(ckpt, "../../etc//x y"),
    "adapter-config-a-list": lambda ckpt, base: (ckpt / "adapter_config.json").write_text("[1]"),
}


@pytest.mark.parametrize("unrecorded", UNRECORDED)
def test_a_lora_base_dtype_nothing_records_is_not_compared(root, tmp_path, unrecorded):
    """Nothing the run left records the base's dtype as a float (no run record, hostile records, a base folder
    gone or without a dtype): as for another tool's checkpoint, only the stored adapter is compared, no error."""
    from fsdp_recipes.train.optimizer import held_dtypes

    ckpt = lora_checkpoint_elsewhere(root, tmp_path, None)
    UNRECORDED[unrecorded](ckpt, base_folder(tmp_path, None))
    assert dtype_mismatch(ckpt, *held_dtypes(built("bfloat16", True), False)) is None


def test_the_checkpoints_own_dtype_is_taken_before_its_runs(root, tmp_path):
    """config.json's dtype is the base as this checkpoint's run loaded it; run_args.json may be a later resume's."""
    from fsdp_recipes.train.optimizer import held_dtypes

    ckpt = lora_checkpoint_elsewhere(root, tmp_path, "bfloat16")
    run_record(ckpt, {"dtype": "float32"})
    adapter_names(ckpt, base_folder(tmp_path, "float32"))
    assert dtype_mismatch(ckpt, *held_dtypes(built("bfloat16", True), False)) is None
