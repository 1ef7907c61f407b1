"""Regional compilation through accelerate launch's dynamo options under FSDP2, on 2 CPU processes: every module
accelerate compiles is compiled in place (module.compile), so FSDP2's hooks still gather and free its parameters
and each rank holds half the model; the run trains."""

from __future__ import annotations

import math

import pytest
from conftest import launch, logged_losses, read_json

# what bench/gpu_check.py's compiled speed rows launch with (docs/training.md, "Speed on a GPU")
REGIONAL = ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")


@pytest.mark.slow  # a launch
def test_regional_compilation_compiles_in_place_and_stays_sharded(tmp_path):
    out = tmp_path / "compiled"
    flags = ["--max_steps", "4", "--logging_steps", "2", "--save_strategy", "no", "--output_dir", str(out)]
    launch("accelerate_configs/zero3.yaml", *flags, launch_args=REGIONAL)
    report = read_json(out / "fsdp_report.json")
    assert (report["fsdp_version"], report["world_size"]) == (2, 2)
    for rank in report["ranks"]:
        # accelerate's compile_regions_fsdp2 on the tiny Llama: the embeddings, 4 decoder layers, the final norm,
        # the rotary embedding and the LM head, each in place (an OptimizedModule wrapper would bypass FSDP2's hooks)
        assert rank["wrapper"] == "FSDP2" and rank["compiled_modules"] == 8, rank
        assert 2 * rank["local_param_elements"] == report["total_param_elements"]
    losses = logged_losses(out)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
