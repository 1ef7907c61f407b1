"""The layout's rules, enforced: who may import whom (each subpackage's docstring says it in its "May import:" line,
and these tests read it from there), no import cycles, the checkpoint toolkit free of torch and transformers at
import time, patches of other libraries only in fsdp_recipes/compat, and no module over SIZE_LIMIT lines.

Every rule is first run on a small tree written here that breaks it, so a checker that sees nothing cannot pass."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = "fsdp_recipes"
LIBRARIES = (
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "datasets",
    "huggingface_hub",
    "safetensors",
    "numpy",
    "tokenizers",
)
# lines: no module of the package is longer
SIZE_LIMIT = 450


def oversize(root: Path) -> dict[str, int]:
    """Module -> lines, for every module of the package under ``root`` longer than SIZE_LIMIT."""
    lengths = {m: len(p.read_text().splitlines()) for m, p in modules(root).items()}
    return {m: n for m, n in lengths.items() if n > SIZE_LIMIT}


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package under ``root``."""
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((root / PACKAGE).rglob("*.py"))
    }


def _type_checking_only(node, parents) -> bool:
    """Inside the body (not the else) of ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``: never run."""
    chain = [*parents, node]
    for parent, child in zip(chain, chain[1:]):
        test = getattr(parent, "test", None) if isinstance(parent, ast.If) else None
        if test is not None and ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") and child in parent.body:
            return True
    return False


# importlib.import_module("x"), __import__("x"), runpy.run_module("x")
DYNAMIC = ("import_module", "__import__", "run_module")


def imports(path: Path, known: dict[str, Path], own: str) -> dict[str, int]:
    """The package modules ``path`` imports (at the top or inside a function: both count), with a line number."""
    found: dict[str, int] = {}
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]

    def visit(node, parents):
        if (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.startswith(PACKAGE)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in DYNAMIC
        ):
            target = node.args[0].value
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != own:
                found.setdefault(target, node.lineno)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not _type_checking_only(node, parents):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                # relative: from the importing module's package
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                # `import fsdp_recipes.ckpt.layout.x` style attribute paths
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != own:
                    found.setdefault(target, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node])

    visit(ast.parse(path.read_text()), [])
    return found


def allowed(root: Path, module: str) -> tuple[str, list[str]]:
    """(the package the rule belongs to, what it may import) from the nearest package docstring's "May import:"."""
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        package = ".".join(parts[:cut])
        init = root.joinpath(*parts[:cut], "__init__.py")
        if init.is_file():
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            # the rule runs from "May import:" to the next blank line
            rules = [p for p in doc.split("\n\n") if p.startswith("May import:")]
            if rules:
                rule = " ".join(rules[0].removeprefix("May import:").split())
                return package, ["*"] if rule.startswith("anything") else [n.strip() for n in rule.split(",")]
    raise AssertionError(f"no 'May import:' line for {module}")


def rule_breaks(root: Path) -> list[str]:
    known = modules(root)
    breaks = []
    for module, path in known.items():
        package, may = allowed(root, module)
        if "*" in may:
            continue
        for target, line in imports(path, known, module).items():
            inside = target == package or target.startswith(package + ".")
            # a shared top-level module: only what its rule names
            if package == PACKAGE:
                inside = False
            if not inside and not any(target == m or target.startswith(m + ".") for m in may):
                breaks.append(f"{path.relative_to(root)}:{line} imports {target} (its rule: {', '.join(may)})")
    return breaks


def cycles(root: Path) -> list[list[str]]:
    known = modules(root)
    graph = {m: set(imports(p, known, m)) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    # Tarjan: a strongly connected set of more than one module is a cycle
    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def patches(path: Path) -> list[str]:
    """Where a file patches another library: internals.patch, setattr on a library module or class, or an
    assignment to an attribute of one."""
    tree = ast.parse(path.read_text())
    library_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            library_names |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in LIBRARIES
            }
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            library_names |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        target = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "patch"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "internals"
        ):
            found.append(f"{path.name}:{node.lineno} internals.patch")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            target = node.args[0]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute):
                    target = t.value
        while isinstance(target, ast.Attribute):
            target = target.value
        if isinstance(target, ast.Name) and target.id in library_names:
            found.append(f"{path.name}:{node.lineno} sets an attribute of {target.id}")
    return found


# --- the rules on this repository --------------------------------------------------------------------------------


def test_every_module_imports_only_what_its_package_may():
    assert rule_breaks(REPO) == []


def test_no_import_cycles():
    assert cycles(REPO) == []


def test_only_compat_patches_other_libraries():
    files = [p for p in (REPO / PACKAGE).rglob("*.py") if "compat" not in p.parts]
    files += [REPO / "train_fsdp.py", *(REPO / "tools").glob("*.py")]
    assert [hit for f in files for hit in patches(f)] == []
    # it sees them
    assert len([hit for f in (REPO / PACKAGE / "compat").glob("*.py") for hit in patches(f)]) >= 3


def test_checkpoint_toolkit_imports_no_torch_or_transformers():
    """Every ckpt module, and the toolkit's tools, imported in a fresh interpreter: torch and transformers stay out."""
    names = [m for m in modules(REPO) if m.startswith(f"{PACKAGE}.ckpt")]
    code = (
        "import sys, runpy\n"
        + "".join(f"import {m}\n" for m in names)
        + "for tool in ('tools/check_checkpoint.py', 'tools/merge_checkpoint.py'):\n"
        + "    runpy.run_path(tool, run_name='not_main')\n"
        + "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'peft') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert len(names) >= 8


def test_toolkit_tools_use_only_the_toolkit():
    known = modules(REPO)
    for tool in ("check_checkpoint.py", "merge_checkpoint.py"):
        used = imports(REPO / "tools" / tool, known, "")
        assert used and not [m for m in used if m.startswith((f"{PACKAGE}.train", f"{PACKAGE}.config"))], (tool, used)


def test_no_module_is_over_the_size_limit():
    assert oversize(REPO) == {}, f"over {SIZE_LIMIT} lines: split them by job"


def test_every_subpackage_says_what_it_is_and_may_import():
    for init in (REPO / PACKAGE).rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 3 and "May import:" in doc, init


# --- the checkers can fail ---------------------------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


BASE = {
    f"{PACKAGE}/__init__.py": '"""Top.\n\nMay import: fsdp_recipes.errors\n"""\n',
    f"{PACKAGE}/errors.py": "",
    f"{PACKAGE}/bounded.py": "from fsdp_recipes.errors import X\n",
    f"{PACKAGE}/ckpt/__init__.py": '"""Toolkit.\n\nMay import: fsdp_recipes.errors, fsdp_recipes.bounded\n"""\n',
    f"{PACKAGE}/train/__init__.py": '"""Training.\n\nMay import: anything in fsdp_recipes\n"""\n',
    f"{PACKAGE}/train/loop.py": "from fsdp_recipes.ckpt import layout\n",
}


@pytest.mark.parametrize(
    "bad, expected",
    [
        # lazy counts
        ("def f():\n    from fsdp_recipes.train import loop\n", "ckpt/layout.py:2 imports fsdp_recipes.train.loop"),
        # relative
        ("from ..train.loop import x\n", "ckpt/layout.py:1 imports fsdp_recipes.train.loop"),
        ("import fsdp_recipes.train.loop\n", "ckpt/layout.py:1 imports fsdp_recipes.train.loop"),
        (
            "import importlib\nimportlib.import_module('fsdp_recipes.train.loop')\n",
            "ckpt/layout.py:2 imports fsdp_recipes.train.loop",
        ),
        ("m = __import__('fsdp_recipes.train.loop')\n", "ckpt/layout.py:1 imports fsdp_recipes.train.loop"),
        (
            "import runpy\nrunpy.run_module('fsdp_recipes.train.loop')\n",
            "ckpt/layout.py:2 imports fsdp_recipes.train.loop",
        ),
        (
            "if not TYPE_CHECKING:\n    from fsdp_recipes.train import loop\n",
            "ckpt/layout.py:2 imports fsdp_recipes.train.loop",
        ),
        (
            "if TYPE_CHECKING:\n    pass\nelse:\n    from fsdp_recipes.train import loop\n",
            "ckpt/layout.py:4 imports fsdp_recipes.train.loop",
        ),
        (
            "if TYPE_CHECKING or True:\n    from fsdp_recipes.train import loop\n",
            "ckpt/layout.py:2 imports fsdp_recipes.train.loop",
        ),
    ],
)
def test_a_forbidden_import_is_found(tmp_path, bad, expected):
    root = _tree(tmp_path, {**BASE, f"{PACKAGE}/ckpt/layout.py": bad})
    assert any(expected in b for b in rule_breaks(root)), rule_breaks(root)


def test_a_shared_module_importing_a_product_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {**BASE, f"{PACKAGE}/ckpt/layout.py": "", f"{PACKAGE}/bounded.py": "from fsdp_recipes.ckpt import layout\n"},
    )
    assert [b for b in rule_breaks(root) if "bounded.py:1 imports fsdp_recipes.ckpt.layout" in b]


def test_allowed_imports_are_not_flagged(tmp_path):
    root = _tree(
        tmp_path,
        {
            **BASE,
            f"{PACKAGE}/ckpt/layout.py": "from fsdp_recipes.bounded import x\nfrom fsdp_recipes.ckpt import other\n",
            f"{PACKAGE}/ckpt/other.py": "if TYPE_CHECKING:\n    from fsdp_recipes.train import loop\n",
        },
    )
    assert rule_breaks(root) == []


def test_a_module_over_the_size_limit_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            **BASE,
            f"{PACKAGE}/ckpt/long.py": "x = 1\n" * (SIZE_LIMIT + 1),
            f"{PACKAGE}/ckpt/at_the_limit.py": "x = 1\n" * SIZE_LIMIT,
        },
    )
    assert oversize(root) == {f"{PACKAGE}.ckpt.long": SIZE_LIMIT + 1}


def test_a_cycle_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            **BASE,
            f"{PACKAGE}/ckpt/a.py": "from fsdp_recipes.ckpt import b\n",
            f"{PACKAGE}/ckpt/b.py": "def f():\n    from fsdp_recipes.ckpt.a import g\n",
        },
    )
    assert cycles(root) == [[f"{PACKAGE}.ckpt.a", f"{PACKAGE}.ckpt.b"]]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load = lambda *a: None\n",
        "from transformers import Trainer\nTrainer.train = None\n",
        "import accelerate.state as s\nsetattr(s.AcceleratorState, 'x', 1)\n",
        "from fsdp_recipes.compat import internals\ninternals.patch('torch.x', None)\n",
    ],
)
def test_a_patch_outside_compat_is_found(tmp_path, source):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert patches(path), source


def test_setting_our_own_attributes_is_not_a_patch(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "import torch\nclass A:\n    pass\na = A()\na.x = torch.zeros(1)\nself_like = A()\nsetattr(self_like, 'y', 1)\n"
    )
    assert patches(path) == []


def test_every_package_docstring_names_its_modules():
    """Each package's docstring (fsdp_recipes and its subpackages) names every module in it: the map a newcomer reads
    in the code stays true; docs/code.md maps the folders."""
    missing = []
    for init in sorted((REPO / PACKAGE).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        missing += [
            p.relative_to(REPO).as_posix()
            for p in sorted(init.parent.glob("*.py"))
            if p.name != "__init__.py" and p.stem not in doc
        ]
    assert missing == [], f"name these in their package's docstring: {missing}"
