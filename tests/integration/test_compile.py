"""Compilation under FSDP2, on 2 CPU processes: accelerate launch's regional compilation compiles every module
accelerate picks in place (module.compile), and transformers' --torch_compile wraps the whole model in torch.compile;
either way FSDP2's hooks still gather and free the parameters (each rank holds half the model), and a run resumed
from its checkpoint ends on the very weights of the run that never stopped."""

from __future__ import annotations

import pytest
from conftest import quick, read_json, same_tensors
from helpers.launch_sequence import run_and_resume

# what bench/gpu_check.py's compiled speed rows launch with (docs/training.md, "Speed on a GPU")
REGIONAL = ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")


# one launch each: the run, then its resume
@pytest.mark.slow
@pytest.mark.parametrize(
    "launch_args, flags, compiled",
    [
        # accelerate's compile_regions_fsdp2 on the tiny Llama: the embeddings, 4 decoder layers, the final norm, the
        # rotary embedding and the LM head, each in place
        (REGIONAL, (), 8),
        # one torch.compile wrapper, which FSDP2 then wraps itself: its hooks run around the compiled call (the
        # resume must not test the compiled module for truth: its len() raised on every rank)
        ((), ("--torch_compile", "true"), 1),
    ],
    ids=["regional", "torch_compile"],
)
def test_a_compiled_run_is_sharded_and_resumes_to_the_same_weights(tmp_path, launch_args, flags, compiled):
    """The run and its resume (from checkpoint-2, into another output_dir) train one after another in one launch
    (tests/helpers/launch_sequence.py, which resets dynamo between runs as a new process would start)."""
    from transformers import AutoModelForCausalLM

    args = [*quick(max_steps="4", save_steps="2"), *flags]
    runs, out, resumed_out = run_and_resume(
        tmp_path, "accelerate_configs/zero3.yaml", args, "checkpoint-2", launch_args=launch_args
    )
    runs("run")
    report = read_json(out / "fsdp_report.json")
    assert (report["fsdp_version"], report["world_size"]) == (2, 2)
    for rank in report["ranks"]:
        assert rank["wrapper"] == "FSDP2" and rank["compiled_modules"] == compiled, rank
        assert 2 * rank["local_param_elements"] == report["total_param_elements"]
    resumed = runs("resumed")
    assert f"resuming from {out / 'checkpoint-2'}" in resumed.stdout + resumed.stderr
    # every rank's output, both runs
    assert "does not support len()" not in resumed.launch_output
    assert read_json(resumed_out / "fsdp_report.json")["ranks"][0]["compiled_modules"] == compiled
    AutoModelForCausalLM.from_pretrained(resumed_out / "model")
    same_tensors(resumed_out / "model" / "model.safetensors", out / "model" / "model.safetensors")
