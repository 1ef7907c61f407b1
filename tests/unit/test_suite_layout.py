"""The suite's own layout: a test file lives in tests/unit/ (whole-package rules), tests/unit/<a subpackage of
fsdp_recipes, or bench, tools, helpers, shared>/, tests/integration/ or tests/gpu/; no two test files share a basename
(pytest imports them by it); a test that launches a run is in the slow tier. Each rule is first run on a small tree
that breaks it, so a checker that sees nothing cannot pass."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import CURRENT_TEST, REPO, SLOW_FIXTURES, run

UNIT_FOLDERS = {"bench", "tools", "helpers", "shared"}
LAUNCH_COMMANDS = (["accelerate", "launch", "x.py"], ["python", "-m", "accelerate.commands.launch"], ["torchrun", "x"])


def misplaced(tests: Path, subpackages: set[str]) -> list[str]:
    """Test files outside the folders the suite has for them."""
    allowed = {("unit",), ("integration",), ("gpu",), *(("unit", name) for name in subpackages | UNIT_FOLDERS)}
    return [
        path.relative_to(tests).as_posix()
        for path in sorted(tests.rglob("test_*.py"))
        if path.relative_to(tests).parent.parts not in allowed
    ]


def shared_basenames(tests: Path) -> dict[str, list[str]]:
    """Basename -> the test files that have it, where more than one does."""
    found: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        found.setdefault(path.name, []).append(path.relative_to(tests).as_posix())
    return {name: paths for name, paths in found.items() if len(paths) > 1}


def _is_slow(node: ast.expr) -> bool:
    return "mark.slow" in ast.unparse(node)


def _launches(function: ast.FunctionDef) -> bool:
    """Whether the test calls launch() or runs accelerate launch or torchrun itself."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "launch":
            return True
        if isinstance(node, ast.List):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if "torchrun" in words or "accelerate.commands.launch" in words or words[:2] == ["accelerate", "launch"]:
                return True
    return False


def unmarked_launches(tests: Path) -> list[str]:
    """Tests that launch a run but are not slow: no slow mark on them or their module, no fixture that launches."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(tests.rglob("*.py"))}
    fixtures = [
        node
        for tree in trees.values()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    ]
    slow_fixtures = set(SLOW_FIXTURES)
    while grown := {f.name for f in fixtures if {a.arg for a in f.args.args} & slow_fixtures} - slow_fixtures:
        slow_fixtures |= grown
    found = []
    for path, tree in trees.items():
        if not path.name.startswith("test_"):
            continue
        module_slow = any(
            isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "pytestmark" and _is_slow(node.value)
            for node in tree.body
        )
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test") and _launches(node)):
                continue
            slow = module_slow or any(_is_slow(d) for d in node.decorator_list)
            if not slow and not {a.arg for a in node.args.args} & slow_fixtures:
                found.append(f"{path.relative_to(tests).as_posix()}::{node.name}")
    return found


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_rules_find_what_breaks_them(tmp_path):
    launch_test = "def test_a(tmp_path):\n    launch('c.yaml')\n"
    tests = _write(
        tmp_path,
        {
            "test_flat.py": "",
            "unit/nowhere/test_x.py": "",
            "unit/ckpt/test_twice.py": "",
            "integration/test_twice.py": "",
            "unit/ckpt/test_launches.py": launch_test,
            "unit/ckpt/test_torchrun.py": "def test_b():\n    run(['torchrun', 'x.py'])\n",
            "unit/ckpt/test_marked.py": "import pytest\n\n\n@pytest.mark.slow\n" + launch_test,
            "integration/test_module.py": "import pytest\n\npytestmark = pytest.mark.slow\n\n\n" + launch_test,
            "unit/ckpt/test_fixture.py": "def test_c(run_dir):\n    launch('c.yaml')\n",
            "unit/ckpt/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef run_dir(trained):\n    pass\n",
        },
    )
    assert misplaced(tests, {"ckpt"}) == ["test_flat.py", "unit/nowhere/test_x.py"]
    assert shared_basenames(tests) == {"test_twice.py": ["integration/test_twice.py", "unit/ckpt/test_twice.py"]}
    assert unmarked_launches(tests) == ["unit/ckpt/test_launches.py::test_a", "unit/ckpt/test_torchrun.py::test_b"]


def test_every_test_file_is_in_a_folder_of_the_suite():
    subpackages = {p.parent.name for p in (REPO / "fsdp_recipes").glob("*/__init__.py")}
    assert {"ckpt", "compat", "config", "train"} <= subpackages
    assert misplaced(REPO / "tests", subpackages) == []


def test_no_two_test_files_share_a_basename():
    assert shared_basenames(REPO / "tests") == {}


def test_every_test_that_launches_is_slow():
    assert unmarked_launches(REPO / "tests") == []


def test_a_launch_from_a_quick_test_fails_before_it_starts(monkeypatch):
    """The run-time guard behind the rule: conftest.run refuses a launch while a quick test runs."""
    monkeypatch.setitem(CURRENT_TEST, "slow", False)
    for cmd in LAUNCH_COMMANDS:
        with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
            run(cmd)
