"""Private symbols of torch/accelerate/transformers/huggingface_hub: all named in fsdp_recipes/compat/internals.py, all
there
in the pinned versions, and a missing one stops with a line naming it instead of a dead patch."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from conftest import REPO, run

from fsdp_recipes.compat import internals

SCANNED = sorted(
    [
        *(REPO / "fsdp_recipes").rglob("*.py"),
        REPO / "train_fsdp.py",
        *(REPO / "tools").glob("*.py"),
        *(REPO / "bench").glob("*.py"),
        *(REPO / "tests" / "helpers").glob("*.py"),
    ]
)
ACCESSORS = {"get", "patch", "attr", "set_attr", "require"}
LIBRARIES = {
    "numpy",
    "torch",
    "accelerate",
    "transformers",
    "huggingface_hub",
    "datasets",
    "peft",
    "safetensors",
    "lightning",
}


# the standard library's: Python is not pinned, and these are stable
STDLIB = {
    "_exit": "os._exit, documented",
    "_actions": "argparse.ArgumentParser._actions, unchanged since Python 2.7",
    # --help's groups (fsdp_recipes/config/helptext.py) and the one-default formatter (fsdp_recipes/console.py):
    # argparse's groups and HelpFormatter hooks, unchanged since Python 2.7 (the way its docs' formatter_class
    # subclasses are written)
    "_action_groups": "argparse",
    "_group_actions": "argparse",
    "_optionals": "argparse",
    "_positionals": "argparse",
    "_get_help_string": "argparse.HelpFormatter",
    "_format_action_invocation": "argparse.HelpFormatter",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_names(trees) -> set[str]:
    """Private names this repository defines itself (functions, classes, variables, attributes it assigns)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if is_private(n)}


def bypasses(sources: dict[str, str]) -> list[str]:
    """Library privates reached without fsdp_recipes.compat.internals: `from x._y import z`, `from x import _y`, and
    `obj._name` where the repository does not define _name. `super()._name` is allowed for a registered override."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    ours, found = own_names(trees.values()), []
    overrides = {p.rsplit(".", 1)[1] for p, (kind, _) in internals.PRIVATE.items() if kind == internals.OVERRIDE}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if any(is_private(part) for part in node.module.split(".")) or any(
                    is_private(a.name) for a in node.names
                ):
                    found.append(
                        f"{name}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}"
                    )
            elif isinstance(node, ast.Attribute) and is_private(node.attr):
                value = node.value
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                    if node.attr not in overrides and node.attr not in STDLIB:
                        found.append(f"{name}:{node.lineno}: super().{node.attr} (override not registered)")
                elif node.attr not in ours and node.attr not in STDLIB:
                    found.append(f"{name}:{node.lineno}: .{node.attr}")
            # getattr(obj, "_name") and its kin: the same reach, spelled as a string
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value)
                and node.args[1].value not in ours
                and node.args[1].value not in STDLIB
            ):
                found.append(f"{name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def registry_strings(sources: dict[str, str]) -> tuple[set[str], list[str]]:
    """(every string constant, the first arguments of internals.get/patch/attr that are not registered)."""
    strings, unregistered = set(), []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ACCESSORS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "internals"
            ):
                for arg in node.args[:1] if node.func.attr not in ("attr", "set_attr") else node.args[1:2]:
                    if isinstance(arg, ast.Constant) and arg.value not in internals.PRIVATE:
                        unregistered.append(f"{name}:{node.lineno}: {arg.value}")
    return strings, unregistered


def sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in SCANNED}


def test_no_library_private_is_reached_around_the_registry():
    assert bypasses(sources()) == []


def test_the_scanner_finds_what_it_must():
    snippet = (
        "from torch.distributed.fsdp import _flat_param\nfrom torch.distributed.fsdp._init_utils import x\n"
        "def f(m):\n    return m._handle\nclass T:\n    def _mine(self):\n        return self._mine, "
        "super()._unknown()\n"
        "def g(m):\n    return getattr(m, '_compiled_call_impl', None), hasattr(m, '_mine'), getattr(m, '__dict__')\n"
    )
    found = bypasses({"snippet.py": snippet})
    assert sorted(f.split(": ", 1)[1] for f in found) == sorted(
        [
            "from torch.distributed.fsdp import _flat_param",
            "from torch.distributed.fsdp._init_utils import x",
            "._handle",
            "super()._unknown (override not registered)",
            "getattr(..., '_compiled_call_impl')",
        ]
    )


def test_every_registered_name_is_used_and_every_used_name_registered():
    strings, unregistered = registry_strings(sources())
    assert unregistered == []
    # a stale entry would hide a real one
    assert sorted(set(internals.PRIVATE) - strings) == []


def test_every_private_method_our_classes_override_is_registered():
    registered = {p for p, (kind, _) in internals.PRIVATE.items() if kind == internals.OVERRIDE}
    missing = []
    for path in sorted((REPO / "fsdp_recipes").rglob("*.py")):
        dotted = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(dotted)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == module.__name__):
                continue
            library_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in LIBRARIES]
            for name in vars(cls):
                for base in library_bases:
                    # ABCMeta sets it on every subclass
                    if is_private(name) and name in vars(base) and name != "_abc_impl":
                        top = base.__module__.split(".")[0]
                        if not any(
                            r.startswith(f"{top}.") and r.endswith(f".{base.__name__}.{name}") for r in registered
                        ):
                            missing.append(f"{cls.__name__}.{name} overrides {base.__module__}.{base.__name__}.{name}")
    assert missing == []


def test_every_registered_symbol_exists_in_the_pinned_versions():
    assert internals.check_all() == []


def test_a_missing_symbol_stops_cpu_fsdp_before_anything_is_patched():
    # a fresh interpreter: the patches are process-wide
    code = (
        "import os, accelerate.state as s, torch\n"
        "from torch.distributed.fsdp import _flat_param\n"
        "del _flat_param.FlatParamHandle.to_cpu  # as if torch had renamed it\n"
        "from fsdp_recipes.compat import cpu_fsdp, internals\n"
        "before = s.AcceleratorState.__init__\n"
        "try:\n    cpu_fsdp.enable()\nexcept internals.InternalsChanged as err:\n    print(err)\n"
        "print(s.AcceleratorState.__init__ is before, os.environ.get('ACCELERATE_USE_CPU'), "
        "torch.Tensor.pin_memory.__name__)\n"
    )
    proc = run(["env", "-u", "ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP=true", "WORLD_SIZE=2", "python", "-c", code])
    assert proc.returncode == 0, proc.stderr
    message, state = proc.stdout.strip().splitlines()
    assert "has no torch.distributed.fsdp._flat_param.FlatParamHandle.to_cpu" in message
    assert "torch==2.13.0" in message and "pip install -r requirements.txt" in message
    # nothing patched, still on the stock path
    assert state.split() == ["True", "None", "pin_memory"]


def test_a_renamed_trainer_method_stops_the_trainer_before_it_trains(monkeypatch):
    from transformers import Trainer

    from fsdp_recipes.train.trainer import FSDPTrainer

    monkeypatch.delattr(Trainer, "_load_optimizer_and_scheduler")
    with pytest.raises(
        internals.InternalsChanged, match=r"transformers .* has no transformers\.Trainer\._load_optimizer_and_scheduler"
    ):
        FSDPTrainer(model=None)


def test_a_missing_instance_attribute_names_the_class():
    class Unit:
        pass

    with pytest.raises(
        internals.InternalsChanged,
        match=r"has no torch\.distributed\.fsdp\.FullyShardedDataParallel\._handle \(on Unit\)",
    ):
        internals.attr(Unit(), "torch.distributed.fsdp.FullyShardedDataParallel._handle")


def test_patch_refuses_to_add_what_is_not_there(monkeypatch):
    from torch.distributed.fsdp import _init_utils

    name = "_check_module_states_for_sync_module_states"
    monkeypatch.delattr(_init_utils, name)
    with pytest.raises(internals.InternalsChanged):
        internals.patch(f"torch.distributed.fsdp._init_utils.{name}", lambda states: None)
    assert not hasattr(_init_utils, name)


def test_pins_are_read_from_requirements():
    text = Path(REPO / "requirements.txt").read_text()
    for package in ("torch", "accelerate", "transformers", "huggingface-hub"):
        pin = internals.pinned(package)
        assert pin and f"{package}=={pin}".lower() in text.lower().replace("_", "-")
