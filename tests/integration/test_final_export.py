"""The final export under real launches: on CPU a collective ends at --ddp_timeout, and an export slower than that
still finishes (no rank waits in a barrier while the others write), in the --save_dtype asked for."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import FAULT_SCRIPT, free_port, header_dtypes, launch, read_json, run


@pytest.mark.slow
def test_ddp_timeout_holds_on_cpu(tmp_path):
    """The control: on CPU a collective really ends at --ddp_timeout (transformers gives a gloo group none;
    compat.cpu_fsdp.apply_ddp_timeout sets it), so the export test below would fail on a timed wait."""
    script = tmp_path / "late.py"
    script.write_text(
        "import time, torch.distributed as dist\n"
        "from fsdp_recipes.compat.cpu_fsdp import apply_ddp_timeout\n"
        "dist.init_process_group('gloo')\n"
        "assert apply_ddp_timeout(2)\n"
        "if dist.get_rank() == 0:\n    time.sleep(6)\n"
        "start = time.monotonic()\n"
        "try:\n    dist.barrier()\nexcept RuntimeError as err:\n"
        "    print(f'rank {dist.get_rank()} timed out after {time.monotonic() - start:.0f} s: "
        "{str(err)[:60]}', flush=True)\n"
    )
    proc = run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)], timeout=120)
    # at the 2 s timeout, not at rank 0's arrival 6 s later (a loaded machine adds a second or so, never four)
    waited = re.search(r"rank 1 timed out after (\d+) s", proc.stdout)
    assert waited and 2 <= int(waited.group(1)) <= 4, proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow
def test_export_slower_than_ddp_timeout_finishes_and_loads_in_bfloat16(tmp_path):
    """Rank 0 writes its part of the final model 20 s late under --ddp_timeout 8: the run exits 0 (no rank
    waits in a barrier bounded by 8 s), both ranks wrote shards, and the folder loads, in bfloat16, with the
    trained weights."""
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    proc = launch(
        "accelerate_configs/zero3.yaml",
        "--max_steps",
        "4",
        "--save_steps",
        "4",
        "--logging_steps",
        "2",
        "--ddp_timeout",
        "8",
        "--save_dtype",
        "bfloat16",
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={"FSDP_FAULT": "0:slowexport:20", "FSDP_EXPORT_PART_MIN": "1000"},
    )
    assert "rank 0 writes its part of the final model 20 s late" in proc.stderr
    assert not (out / ".final-sharded").exists() and not (out / ".export-tmp").exists()
    report = read_json(out / "fsdp_report.json")
    assert report["precision"]["saved_model"] == report["export"]["dtype"] == "bfloat16"
    assert report["precision"]["master_weights"] == "float32"
    assert report["export"]["writers"] == 2 and report["export"]["seconds"] >= 20
    shards = sorted((out / "model").glob("model-*.safetensors"))
    assert len(shards) == report["export"]["shards"] >= 2 and (out / "model" / "model.safetensors.index.json").is_file()
    assert {d for s in shards for d in header_dtypes(s)} == {"BF16"}
    assert read_json(out / "model" / "config.json")["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.dtype == torch.bfloat16
    merge_fsdp_weights(
        str(out / "checkpoint-4" / "pytorch_model_fsdp_0"), str(tmp_path / "ref"), safe_serialization=True
    )
    reference, loaded = load_file(tmp_path / "ref" / "model.safetensors"), model.state_dict()
    assert set(reference) == set(loaded)
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in reference.items())
