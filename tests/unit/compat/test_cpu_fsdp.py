"""The CPU FSDP module: applies only where needed; without it a CPU launch is not FSDP and the script says so."""

from __future__ import annotations

import json

import pytest
from conftest import run

# A fresh interpreter: the patches are process-wide. SIMULATE_ACCELERATOR makes torch report an accelerator, as on
# a GPU node, where nothing may be patched. Prints, per case: applied, AcceleratorState patched, ACCELERATE_USE_CPU,
# pin_memory patched.
PROBE = """
import json, os, sys, accelerate.state as s, torch
from fsdp_recipes.compat import cpu_fsdp
for env in json.loads(sys.argv[1]):
    for key in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "ACCELERATE_USE_CPU"):
        os.environ.pop(key, None)
    os.environ.update({k: v for k, v in env.items() if k != "SIMULATE_ACCELERATOR"})
    torch.accelerator.is_available = (lambda: True) if "SIMULATE_ACCELERATOR" in env else lambda: False
    before = s.AcceleratorState.__init__
    active = cpu_fsdp.enable()
    patched = s.AcceleratorState.__init__ is not before
    print(active, patched, os.environ.get("ACCELERATE_USE_CPU"), torch.Tensor.pin_memory.__name__ == "<lambda>")
"""


def probe(cases: list[dict]) -> list[list[str]]:
    proc = run(["python", "-c", PROBE, json.dumps(cases)])
    assert proc.returncode == 0, proc.stderr
    return [line.split() for line in proc.stdout.splitlines()]


def test_enable_applies_to_multiprocess_fsdp_without_accelerator():
    assert probe([{"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}]) == [["True", "True", "true", "True"]]


def test_enable_applies_nowhere_else():
    """Cases that must patch nothing, in one interpreter: a case that wrongly patched would show in its own line."""
    cases = [
        {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "1"},
        {"ACCELERATE_USE_FSDP": "false", "WORLD_SIZE": "2"},
        {"WORLD_SIZE": "2"},
        # a GPU node: the stock path
        {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "SIMULATE_ACCELERATOR": "1"},
    ]
    assert probe(cases) == [["False", "False", "None", "False"]] * len(cases)


def test_unwrapped_model_under_an_fsdp_launch_is_refused(monkeypatch, tmp_path):
    """The guard after preparation: whatever the cause, a model that is not FSDP-wrapped as asked stops the run."""
    from accelerate import Accelerator
    from conftest import REPO
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.errors import NotShardedError
    from fsdp_recipes.train.sharding import verify_and_report

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))
    with pytest.raises(NotShardedError, match="asks for FSDP2 but the model is LlamaForCausalLM"):
        # this process: no FSDP
        verify_and_report(model, Accelerator(cpu=True), str(tmp_path))


def test_every_program_that_starts_a_process_group_ends_it():
    """A gloo process group left to interpreter teardown can abort a run that finished (SIGABRT, "terminate called
    without an active exception", pytorch/pytorch#190489): each program we launch destroys its group or leaves
    with os._exit after its atexit handlers (train_fsdp.py, and the scripts that run it)."""
    import re

    from conftest import REPO

    starts = re.compile(r"\b(Accelerator|Trainer|FSDPTrainer|init_process_group)\(")
    ends = ("end_training()", "destroy_process_group()", "os._exit(")
    programs = [REPO / "train_fsdp.py", *(REPO / "bench").glob("*.py"), *(REPO / "tests" / "helpers").glob("*.py")]
    text = {p: p.read_text() for p in programs}
    # train_fsdp.py builds its trainer in its Run and leaves through the run's exit policy
    text[REPO / "train_fsdp.py"] += "".join(
        (REPO / "fsdp_recipes/train" / m).read_text() for m in ("run.py", "exits.py")
    )
    starting = [p for p in programs if starts.search(text[p])]
    assert {p.name for p in starting} >= {"train_fsdp.py", "bare_trainer.py", "accelerate_loop.py", "synthetic.py"}
    assert [p.name for p in starting if not any(end in text[p] for end in ends)] == []
