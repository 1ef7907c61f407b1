"""Runs on CPU: FSDP over gloo needs two processes or more (one is refused before anything loads); on a CPU without
native bf16 the shipped bf16 config computes in fp32 and says so once, --cpu_bf16 true keeps bf16, and weights loaded
as bf16 are reported as computing in bf16."""

from __future__ import annotations

import pytest
from conftest import launch, read_json
from helpers.zero3_runs import zero3_runs as shared_zero3_runs

from fsdp_recipes.compat.cpu_fsdp import native_bf16, read_cpuinfo


# a launch
@pytest.mark.slow
def test_single_process_fsdp_launch_on_cpu_stops_with_clear_error(tmp_path):
    """One process gets no gloo group, so accelerate would silently train unwrapped: the script refuses first."""
    proc = launch(
        "accelerate_configs/zero3.yaml",
        "--max_steps",
        "2",
        "--output_dir",
        str(tmp_path / "out"),
        launch_args=("--num_processes", "1"),
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "train_fsdp.py: error: FSDP is asked for, but without a GPU FSDP runs over gloo and needs 2 or more processes; "
        "this launch has 1: pass --num_processes 2"
    ) in proc.stderr
    assert not (tmp_path / "out").exists()


without_native_bf16 = pytest.mark.skipif(
    native_bf16(read_cpuinfo()) is not False, reason="this CPU computes bf16 natively (or cannot tell)"
)


NOTE = "computes in fp32 here: this CPU"


@pytest.mark.slow
@without_native_bf16
def test_shipped_bf16_config_runs_fp32_here_and_says_so_once(trained):
    # the session's run of the shipped config
    proc = trained("accelerate_configs/zero3.yaml")
    assert (proc.stdout + proc.stderr).count(NOTE) == 1, proc.stderr[-3000:]
    # rank 0's log
    line = next(line for line in proc.stdout.splitlines() if NOTE in line).split(" INFO train_fsdp: ", 1)[1]
    assert line.startswith("bf16 mixed precision (accelerate's mixed_precision: bf16) computes in fp32 here")
    assert line.endswith("--cpu_bf16 true keeps bf16")
    precision = proc.report["precision"]
    assert precision["compute"] == precision["gradient_reduction"] == precision["master_weights"] == "float32"
    assert precision["cpu_bf16"]["native_bf16"] is False and precision["cpu_bf16"]["compute"] == "float32"
    assert precision["cpu_bf16"]["note"] == line


@pytest.mark.slow
@without_native_bf16
def test_cpu_bf16_true_keeps_bf16_here(trained):
    # test_training's run of it
    proc = trained("accelerate_configs/zero3.yaml", "--cpu_bf16", "true")
    assert NOTE not in proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).count("keeps bf16 compute (--cpu_bf16 true) although this CPU") == 1
    precision = proc.report["precision"]
    assert (
        precision["compute"] == precision["gradient_reduction"] == "bfloat16"
        and precision["master_weights"] == "float32"
    )
    assert precision["cpu_bf16"]["forced"] is True and precision["cpu_bf16"]["compute"] == "bfloat16"


@pytest.mark.slow
@without_native_bf16
def test_dtype_bfloat16_is_reported_as_what_it_computes(tmp_path):
    """The shipped bf16 config turns bf16 mixed precision into fp32 here, but weights loaded as bf16 still compute in
    bf16: the run says so once, and fsdp_report.json's cpu_bf16 says bf16, as its compute does."""
    proc = launch(
        "accelerate_configs/zero3.yaml",
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--dtype",
        "bfloat16",
        "--output_dir",
        str(tmp_path / "out"),
    )
    out = proc.stdout + proc.stderr
    assert out.count("the model's weights are bfloat16 (--dtype bfloat16): they compute in bf16") == 1, out[-3000:]
    precision = read_json(tmp_path / "out" / "fsdp_report.json")["precision"]
    assert precision["master_weights"] == precision["compute"] == precision["cpu_bf16"]["compute"] == "bfloat16", (
        precision
    )
    assert (
        precision["cpu_bf16"]["note"]
        == "the model's weights are bfloat16: they compute in bfloat16 whatever the mixed precision"
    )


@pytest.fixture(scope="module")
def zero3_runs(trained, tmp_path_factory):
    """tests/helpers/zero3_runs.py's runs, one launch shared with other test files."""
    return shared_zero3_runs(trained, tmp_path_factory)


# a launch
@pytest.mark.slow
def test_an_auto_batch_size_is_chosen_before_loading_said_once_and_trained(zero3_runs):
    """per_device_train_batch_size auto on 2 CPU processes: the host's memory over 2 leaves the tiny model the cap;
    rank 0 says the choice once, and the run records and trains that batch. The run shares its launch with others
    (its part of the output after its marker line): no other run says the choice, so the whole launch says it once."""
    from fsdp_recipes.config.batch_size import MAX_AUTO_BATCH

    # --max_steps 2 --save_strategy no --block_size 32
    out, proc = zero3_runs("auto_batch")
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "per_device_train_batch_size auto:" in line]
    assert len(said) == 1 and f"auto: {MAX_AUTO_BATCH} sequence(s) of 32 tokens" in said[0], said
    assert proc.launch_output.count("per_device_train_batch_size auto:") == 1, proc.launch_output[-3000:]
    assert "over 2 process(es) (no GPU here" in said[0] and f"the cap of {MAX_AUTO_BATCH}" in said[0]
    recorded = read_json(out / "run_args.json")
    assert recorded["training"]["per_device_train_batch_size"] == MAX_AUTO_BATCH, recorded["training"]
    assert read_json(out / "trainer_state.json")["train_batch_size"] == MAX_AUTO_BATCH
