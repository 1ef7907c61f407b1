"""No module is tested for truth anywhere in the package or train_fsdp.py: ``model or self.model_wrapped`` calls the
module's ``__len__``, which a torch.compile'd module lacks (TypeError: LlamaForCausalLM does not support len()) and
an empty ModuleList or Sequential makes false. The scan finds every such test of a module-like name, and leaves names
whose annotation says they hold no module. (A compiled run's resume: tests/integration/test_fault_tolerance.py.)"""

from __future__ import annotations

import ast
import re

import pytest
from conftest import REPO

SCANNED = sorted([*(REPO / "fsdp_recipes").rglob("*.py"), REPO / "train_fsdp.py"])
# a name that may hold a torch module: model, module, wrapped and any name ending in one of them (base_model,
# model_wrapped)
MODULE_LIKE = re.compile(r"(?:^|_)(?:model|module|wrapped|unwrapped)$")
# an annotation made of these alone says the name holds no module (a path, a flag, a model's name)
NOT_MODULES = {
    "str",
    "bool",
    "int",
    "float",
    "None",
    "Path",
    "os",
    "PathLike",
    "dict",
    "list",
    "tuple",
    "set",
    "Optional",
}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _tested(node: ast.AST) -> list[ast.AST]:
    """The expressions ``node`` takes the truth of (``x or y`` tests x; y too where the whole is tested)."""
    if isinstance(node, ast.BoolOp):
        return node.values[:-1]
    if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
        tested = [node.test]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        tested = [node.operand]
    elif isinstance(node, ast.comprehension):
        tested = list(node.ifs)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "bool":
        tested = list(node.args)
    else:
        return []
    # `if a or b:` tests b as well
    for expr in tested:
        if isinstance(expr, ast.BoolOp):
            tested.append(expr.values[-1])
    return tested


def _scalar_annotation(annotation: ast.AST | None) -> bool:
    if annotation is None:
        return False
    # a quoted one: "str | None"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)
    }
    return bool(names) and names <= NOT_MODULES


def _bool_value(value: ast.AST) -> bool:
    """An assigned value that is no module: a comparison, a negation, a string or bool constant, an f-string."""
    return (
        isinstance(value, (ast.Compare, ast.JoinedStr))
        or (isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not))
        or (isinstance(value, ast.Constant) and isinstance(value.value, (str, bool)))
    )


def _no_module(node: ast.AST, name: str, parents: dict) -> bool:
    """Whether what ``node`` names is known to be no module: an annotation of the enclosing function's parameter or
    local (a ``self.`` attribute: of the enclosing class's fields), or every assignment to it in that function a
    comparison or a constant."""
    is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    if isinstance(node, ast.Attribute) and not is_self:
        return False
    scope = parents.get(node)
    while scope is not None:
        if is_self and isinstance(scope, ast.ClassDef):
            return any(
                isinstance(s, ast.AnnAssign) and _name(s.target) == name and _scalar_annotation(s.annotation)
                for s in scope.body
            )
        if not is_self and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = scope.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.arg == name:
                    return _scalar_annotation(arg.annotation)
            body = list(ast.walk(scope))
            if any(
                isinstance(s, ast.AnnAssign) and _name(s.target) == name and _scalar_annotation(s.annotation)
                for s in body
            ):
                return True
            values = [
                s.value
                for s in body
                if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
            ]
            if values:
                return all(map(_bool_value, values))
        scope = parents.get(scope)
    return False


def module_truth_tests(source: str, label: str) -> list[str]:
    """Every place ``source`` takes the truth of a name that may hold a module (``x or y``, ``if x:``, ``not x``,
    ``a if x else b``, ``bool(x)``): ``label:line: the expression``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        for tested in _tested(node):
            name = _name(tested)
            if name and MODULE_LIKE.search(name) and not _no_module(tested, name, parents):
                found.append(f"{label}:{tested.lineno}: {ast.get_source_segment(source, tested)}")
    return found


@pytest.mark.parametrize(
    "code",
    [
        # the bug as it was
        "def f(self, ckpt, model=None):\n    return (model or self.model_wrapped).named_parameters()",
        "def f(self):\n    if self.model_wrapped:\n        return 1",
        "def f(module):\n    return not module",
        "def f(unwrapped):\n    return 1 if unwrapped else 2",
        "def f(base_model):\n    assert base_model",
        "def f(trainer):\n    while trainer.model:\n        pass",
        "def f(models):\n    return [m for m in models if m.base_model]",
        "def f(model):\n    return bool(model)",
        "def f(model, module):\n    if model is not None and module:\n        pass",
        "def f(x):\n    model = build(x)\n    return model and model.config",
        "def f(model: 'torch.nn.Module | None'):\n    return model or 1",
    ],
)
def test_the_scan_finds_a_module_tested_for_truth(code):
    assert len(module_truth_tests(code, "snippet")) == 1, code


@pytest.mark.parametrize(
    "code",
    [
        "def f(self, model=None):\n    return model if model is not None else self.model_wrapped",
        "def f(model: str | None = None):\n    return model or 'x'",
        "def f(base_model: 'str | None'):\n    return 1 if base_model else 2",
        "def f(names, prefix):\n    wrapped = f'{prefix}.x' in names\n    return 1 if wrapped else 2",
        "class S:\n    base_model: str | None = None\n\n    def f(self):\n        return self.base_model or '-'",
        "def f(args):\n    return args.use_peft or args.model_name_or_path",
    ],
)
def test_the_scan_leaves_names_that_hold_no_module(code):
    assert module_truth_tests(code, "snippet") == [], code


def test_no_module_is_tested_for_truth():
    """Compare a module with None: its truth is its len(), which a torch.compile'd module (and ModuleList, Sequential
    when empty) makes something other than "given"."""
    found = [hit for path in SCANNED for hit in module_truth_tests(path.read_text(), path.relative_to(REPO).as_posix())]
    assert found == [], "\n".join(found)
