"""Compilation under FSDP2, on 2 CPU processes: accelerate launch's regional compilation compiles every module
accelerate picks in place (module.compile), and transformers' --torch_compile wraps the whole model in torch.compile;
either way FSDP2's hooks still gather and free the parameters, each rank holds half the model, and the run trains."""

from __future__ import annotations

import math

import pytest
from conftest import launch, logged_losses, read_json

# what bench/gpu_check.py's compiled speed rows launch with (docs/training.md, "Speed on a GPU")
REGIONAL = ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")


@pytest.mark.slow  # a launch each
@pytest.mark.parametrize(
    "launch_args, flags, compiled",
    [
        # accelerate's compile_regions_fsdp2 on the tiny Llama: the embeddings, 4 decoder layers, the final norm, the
        # rotary embedding and the LM head, each in place
        (REGIONAL, (), 8),
        # one torch.compile wrapper, which FSDP2 then wraps itself: its hooks run around the compiled call
        ((), ("--torch_compile", "true"), 1),
    ],
    ids=["regional", "torch_compile"],
)
def test_a_compiled_run_is_compiled_sharded_and_trains(tmp_path, launch_args, flags, compiled):
    out = tmp_path / "compiled"
    args = ["--max_steps", "4", "--logging_steps", "2", "--save_strategy", "no", "--output_dir", str(out), *flags]
    launch("accelerate_configs/zero3.yaml", *args, launch_args=launch_args)
    report = read_json(out / "fsdp_report.json")
    assert (report["fsdp_version"], report["world_size"]) == (2, 2)
    for rank in report["ranks"]:
        assert rank["wrapper"] == "FSDP2" and rank["compiled_modules"] == compiled, rank
        assert 2 * rank["local_param_elements"] == report["total_param_elements"]
    losses = logged_losses(out)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
