"""The CPU FSDP module: applies only where needed; without it a CPU launch is not FSDP and the script says so."""

from __future__ import annotations

import pytest

from conftest import launch, run


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}, True),
        ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "1"}, False),
        ({"ACCELERATE_USE_FSDP": "false", "WORLD_SIZE": "2"}, False),
        ({"WORLD_SIZE": "2"}, False),
        ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "SIMULATE_ACCELERATOR": "1"}, False),  # a GPU node: stock path
    ],
)
def test_enable_applies_only_to_multiprocess_fsdp_without_accelerator(env, expected):
    # a fresh interpreter: the patches are process-wide. SIMULATE_ACCELERATOR makes torch report an accelerator,
    # as on a GPU node, where nothing may be patched.
    code = (
        "import os, accelerate.state as s, torch\n"
        "if os.environ.get('SIMULATE_ACCELERATOR'): torch.accelerator.is_available = lambda: True\n"
        "from fsdp_recipes import cpu_fsdp\n"
        "before = s.AcceleratorState.__init__\n"
        "active = cpu_fsdp.enable()\n"
        "patched = s.AcceleratorState.__init__ is not before\n"
        "print(active, patched, os.environ.get('ACCELERATE_USE_CPU'), torch.Tensor.pin_memory.__name__ == '<lambda>')\n"
    )
    proc = run(["env", "-u", "ACCELERATE_USE_FSDP", "-u", "WORLD_SIZE", "-u", "ACCELERATE_USE_CPU", *[f"{k}={v}" for k, v in env.items()], "python", "-c", code])
    assert proc.returncode == 0, proc.stderr
    if expected:
        assert proc.stdout.split() == ["True", "True", "true", "True"]
    else:
        assert proc.stdout.split() == ["False", "False", "None", "False"]


def test_single_process_fsdp_launch_on_cpu_stops_with_clear_error(tmp_path):
    """One process gets no gloo group, so accelerate would silently train unwrapped: the script refuses first."""
    proc = launch(
        "accelerate_configs/zero3.yaml", "--max_steps", "2", "--output_dir", str(tmp_path / "out"),
        launch_args=("--num_processes", "1"), check=False,
    )
    assert proc.returncode != 0
    assert ("train_fsdp.py: error: FSDP is asked for, but without a GPU FSDP runs over gloo and needs 2 or more processes; "
            "this launch has 1: pass --num_processes 2") in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unwrapped_model_under_an_fsdp_launch_is_refused(monkeypatch, tmp_path):
    """The guard after preparation: whatever the cause, a model that is not FSDP-wrapped as asked stops the run."""
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import REPO
    from fsdp_recipes.checks import NotShardedError, verify_and_report

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))
    with pytest.raises(NotShardedError, match="asks for FSDP2 but the model is LlamaForCausalLM"):
        verify_and_report(model, Accelerator(cpu=True), str(tmp_path))  # this process: no FSDP
