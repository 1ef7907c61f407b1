"""Every reader of a user's or a run's small files refuses hostile ones in one line, fast: recipes (parse_args,
load_recipe), accelerate configs (tools/check_config.py, tools/estimate_memory.py --config), a checkpoint's
fsdp_report.json and trainer_state.json (tools/check_checkpoint.py, and the resume's second read of the step);
and estimate_memory.py's numbers are range-checked.

The cases are generated: each hostile file (folders, pipes, devices, oversize, binary, YAML aliases, values of
every wrong JSON type) meets each reader. Each runs in this process under an alarm and a lowered soft limit on
the address space (restored after it): a reader that regresses to blocking on a pipe or reading /dev/zero to
the end fails its case with TimeoutError or MemoryError instead of hanging the suite or the machine.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import signal
import time
from pathlib import Path

import pytest
from conftest import REPO, make_special

from fsdp_recipes.bounded import REPORT_LIMIT, STATE_LIMIT, YAML_LIMIT
from fsdp_recipes.config.parse import load_recipe, parse_args
from fsdp_recipes.errors import RecipeError

# the slowest case takes a fifth of that; a hang is stopped by the alarm at twice this
CASE_SECONDS = 2
LAUGHS = "".join(
    # 346 bytes that a YAML loader expanding aliases turns into 10^9 strings
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(f"{n}: &{n} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, n in zip("abcdefgh", "bcdefghi")),
    ]
)
JSON_TOPS = {
    "list": [1, 2],
    "string": "text",
    "null": None,
    "float_1e9": 1e9,
    "negative": -5,
    "int_10e30": 10**30,
    "bool": True,
}
# the same shapes as values of one key of a checkpoint's JSON files
WRONG_VALUES = {
    "null": None,
    "string": "2",
    "float_1e9": 1e9,
    "int_1e9": 10**9,
    "negative": -1,
    "zero": 0,
    "int_10e30": 10**30,
    "bool": True,
    "fraction": 2.5,
    "list": [1],
    "object": {"a": 1},
}
# a DDP run's, as fsdp_recipes.train.sharding writes it
REPORT = {"fsdp_version": None, "world_size": 1, "sharding_strategy": None}
STEP = 3


# ----- the hostile files -----


def special(path: Path, kind: str, limit: int) -> None:
    """Make ``path`` a hostile file of a kind in SPECIAL (for "missing": nothing)."""
    if kind in ("directory", "fifo", "link_to_dev_zero"):
        make_special(path, kind)
    # one byte over, sparse: refused by its size, never read
    elif kind == "oversize":
        with open(path, "wb") as f:
            f.truncate(limit + 1)


SPECIAL = ["directory", "fifo", "link_to_dev_zero", "oversize", "missing"]
# contents no reader may trip over
BROKEN = {
    "binary": bytes(range(256)) * 4,
    "not_utf8": "learning_rate: caf\xe9\n".encode("latin-1"),
    "truncated_json": b'{"distributed_type": "FSDP", "num_proc',
    # deeper than the recursion limit of a parser without a bound
    "deep_nesting": b"a: " + b"[" * 3_000,
    "int_of_5000_digits": b'{"a": ' + b"9" * 5000 + b"}",
    **{f"json_{name}": json.dumps(value).encode() for name, value in JSON_TOPS.items()},
}
YAML_ONLY = {
    "billion_laughs": LAUGHS.encode(),
    "one_harmless_alias": b"learning_rate: &lr 1.0e-4\nwarmup_ratio: *lr\n",
    "list_at_top": b"- learning_rate: 1.0e-4\n- block_size: 64\n",
    "key_that_is_a_number": b"1: one\n",
    # within the size limit
    "10000_unknown_keys": "".join(f"unknown_key_{i}: {i}\n" for i in range(10_000)).encode(),
}
# 60 MB of `key: value` lines
UNKNOWN_KEYS_60MB = "unknown_keys_60MB"


def yaml_cases(folder: Path) -> dict[str, str]:
    """case -> path, for the readers of YAML files (recipes, accelerate configs)."""
    folder.mkdir()
    cases = {"dev_zero": "/dev/zero"}
    for kind in SPECIAL:
        special(folder / f"{kind}.yaml", kind, YAML_LIMIT)
        cases[kind] = str(folder / f"{kind}.yaml")
    for name, content in {**BROKEN, **YAML_ONLY}.items():
        (folder / f"{name}.yaml").write_bytes(content)
        cases[name] = str(folder / f"{name}.yaml")
    line = b"unknown_key_with_a_long_name: 12345\n"
    (folder / f"{UNKNOWN_KEYS_60MB}.yaml").write_bytes(line * (60_000_000 // len(line)))
    cases[UNKNOWN_KEYS_60MB] = str(folder / f"{UNKNOWN_KEYS_60MB}.yaml")
    return cases


def fake_checkpoint(folder: Path) -> Path:
    """A complete, resumable checkpoint of a one-process run without FSDP, written by hand (no training run):
    the files checkpoint_status reads, each as small as it can be."""
    import torch
    from safetensors.torch import save_file

    ckpt = folder / f"checkpoint-{STEP}"
    ckpt.mkdir(parents=True)
    save_file({"weight": torch.zeros(2)}, ckpt / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
    torch.save({"last_epoch": STEP}, ckpt / "scheduler.pt")
    # the keys the Trainer reads
    torch.save({"python": [1, 2], "numpy": [3], "cpu": torch.zeros(2)}, ckpt / "rng_state.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": STEP, "log_history": []}))
    (ckpt / "fsdp_report.json").write_text(json.dumps(REPORT))
    return ckpt


def checkpoint_plan() -> dict[str, tuple]:
    """case -> (file, what replaces it): ("special", kind), ("content", bytes) or ("value", key, value)."""
    plan = {}
    for file in ("fsdp_report.json", "trainer_state.json"):
        for kind in SPECIAL:
            # optional: other scripts' checkpoints lack it
            if not (kind == "missing" and file == "fsdp_report.json"):
                plan[f"{file}-{kind}"] = (file, "special", kind)
        for name, content in BROKEN.items():
            plan[f"{file}-{name}"] = (file, "content", content)
    for file, key in [("fsdp_report.json", k) for k in ("world_size", "fsdp_version", "sharding_strategy")] + [
        ("trainer_state.json", "global_step")
    ]:
        for name, value in WRONG_VALUES.items():
            # valid ones
            if (key, value) not in (("fsdp_version", None), ("sharding_strategy", None), ("sharding_strategy", "2")):
                plan[f"{file}-{key}-{name}"] = (file, "value", key, value)
    return plan


def checkpoint_cases(folder: Path) -> dict[str, str]:
    """case -> a copy of the fake checkpoint with fsdp_report.json or trainer_state.json replaced."""
    import shutil

    base = fake_checkpoint(folder / "base")
    cases = {"pristine": str(base)}
    good = {"fsdp_report.json": REPORT, "trainer_state.json": {"global_step": STEP}}
    limits = {"fsdp_report.json": REPORT_LIMIT, "trainer_state.json": STATE_LIMIT}
    for name, (file, how, *what) in checkpoint_plan().items():
        ckpt = folder / name / base.name
        shutil.copytree(base, ckpt)
        (ckpt / file).unlink()
        if how == "special":
            special(ckpt / file, what[0], limits[file])
        elif how == "content":
            (ckpt / file).write_bytes(what[0])
        else:
            (ckpt / file).write_text(json.dumps({**good[file], what[0]: what[1]}))
        cases[name] = str(ckpt)
    return cases


ESTIMATE_OPTIONS = ["--nproc-per-node", "--nnodes", "--micro-batch", "--seq-len", "--gpu-memory", "model"]
BAD_NUMBERS = ["0", "-1", "-5", "1e999", "nan", "abc"]


def estimate_cases() -> dict[str, list[str]]:
    """case -> estimate_memory.py arguments with one numeric option out of range or not a number."""
    cases = {}
    for option in ESTIMATE_OPTIONS:
        for value in BAD_NUMBERS:
            if option == "model":
                # 'abc' is a hub id, looked up (tests/unit/config/test_memory.py: 'seven billion')
                if value != "abc":
                    # `--`: argparse would take -1B for an option
                    cases[f"model={value}"] = ["--", value]
                    cases[f"model={value}B"] = ["--", f"{value}B"]
            else:
                cases[f"{option}={value}"] = ["7B", f"{option}={value}"]
    return cases


# ----- the readers, each case bounded -----


def tool(script: str):
    """tools/<script>.py's main(), imported as the tests of the tools do."""
    spec = importlib.util.spec_from_file_location(f"{script}_cli", REPO / "tools" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _address_space() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1]) * 1024


def _hung(*_):
    raise TimeoutError(f"still running after {2 * CASE_SECONDS} s")


def bounded(call, *args, capsys) -> dict:
    """{outcome, message, stderr, seconds} of call(*args), run under an alarm and 1 GiB more address space than
    this process has now. outcome: the exit code (returned, or argparse's SystemExit); message: what it printed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + (1 << 30)
    previous = signal.signal(signal.SIGALRM, _hung)
    capsys.readouterr()
    start = time.monotonic()
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    signal.alarm(2 * CASE_SECONDS)
    try:
        outcome = call(*args)
    except SystemExit as stop:
        outcome = stop.code
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)
    seconds = time.monotonic() - start
    said = capsys.readouterr()
    return {"outcome": outcome, "message": said.out + said.err, "stderr": said.err, "seconds": seconds}


def recipe_reader(path: str):
    """parse_args takes a .yaml; /dev/zero goes to load_recipe, the function it reads recipes with."""
    try:
        parse_args([path]) if path.endswith(".yaml") else load_recipe(Path(path))
    except RecipeError as err:
        print(err)
        return "RecipeError"
    return "accepted"


@pytest.fixture(scope="module")
def yaml_files(tmp_path_factory) -> dict[str, str]:
    """The YAML cases, after one run of each reader on a sound file: what they import on first use (accelerate's
    launch parser, transformers' argument classes) is imported before any case's alarm starts."""
    from fsdp_recipes.config.flags import known_accelerate_keys

    known_accelerate_keys()
    folder = tmp_path_factory.mktemp("bounded")
    (folder / "recipe.yaml").write_text("learning_rate: 1.0e-4\n")
    # the recipe names no model: refused after it was read
    with pytest.raises(RecipeError):
        parse_args([str(folder / "recipe.yaml")])
    return yaml_cases(folder / "yaml")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The checkpoint cases, after one check of the sound one (its first run imports torch and numpy)."""
    cases = checkpoint_cases(tmp_path_factory.mktemp("bounded") / "checkpoints")
    tool("check_checkpoint")([cases["pristine"]])
    return cases


def one_line(result: dict) -> str:
    lines = [line for line in result["message"].splitlines() if line.strip()]
    assert len(lines) == 1, result
    assert result["seconds"] < CASE_SECONDS, result
    return lines[0]


# ----- the cases -----

YAML_CASES = ["dev_zero", *SPECIAL, *BROKEN, *YAML_ONLY, UNKNOWN_KEYS_60MB]
# the path's tail
YAML_PATHS = {name: "/dev/zero" if name == "dev_zero" else f"/{name}.yaml" for name in YAML_CASES}


@pytest.mark.parametrize("case", YAML_CASES)
def test_recipe(yaml_files, case, capsys):
    result = bounded(recipe_reader, yaml_files[case], capsys=capsys)
    assert result["outcome"] == "RecipeError", result
    line = one_line(result)
    assert line.startswith("recipe '") and YAML_PATHS[case] in line, line
    # parsed whole, it took minutes
    if case == UNKNOWN_KEYS_60MB:
        assert result["seconds"] < 0.5 and "over the 262,144-byte limit" in line, result


def test_launcher_reads_the_config_in_force_within_bounds(yaml_files, monkeypatch):
    """train_fsdp.py rebuilds the settings of its `accelerate launch` from the config file
    (fsdp_recipes.config.launcher):
    a refused file is a RecipeError, which train_fsdp.py prints as its one error line."""
    from fsdp_recipes.config import launcher
    from fsdp_recipes.errors import UnreadableFile

    for case in ("billion_laughs", "list_at_top", "binary", UNKNOWN_KEYS_60MB):
        argv = ["--config_file", yaml_files[case], "train_fsdp.py"]
        with pytest.raises(UnreadableFile, match=f"^accelerate config '{yaml_files[case]}' "):
            launcher.from_launch_args(argv, Path.cwd())
        # as if launched so (the lambda is called at once, in the loop)
        monkeypatch.setattr(launcher, "find_accelerate_launch", lambda: (argv, Path.cwd()))  # noqa: B023
        with pytest.raises(RecipeError, match=f"^accelerate config '{yaml_files[case]}' "):
            launcher.launch_settings()


@pytest.mark.parametrize("case", YAML_CASES)
def test_check_config(yaml_files, case, capsys):
    result = bounded(tool("check_config"), [yaml_files[case]], capsys=capsys)
    assert result["outcome"] == 1 and not result["message"].startswith("ok"), result
    line = one_line(result)
    assert line.startswith("error: ") and YAML_PATHS[case] in line, line


MESH_KEYS = [
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size",
    "parallelism_config_cp_size",
]


@pytest.mark.parametrize("value", ["two", "[2]", "-1", "0", "2.5", "true", ".inf", "'2x'"])
@pytest.mark.parametrize("key", MESH_KEYS)
def test_check_config_mesh_sizes_that_are_not_numbers(tmp_path, key, value, capsys):
    """An FSDP2 config's parallelism_config sizes given as words (or lists, fractions...): one error naming the key."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "distributed_type: FSDP\nnum_processes: 4\nnum_machines: 2\nmixed_precision: bf16\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        f"parallelism_config:\n  {key}: {value}\n"
    )
    result = bounded(tool("check_config"), [str(config)], capsys=capsys)
    assert result["outcome"] == 1, result
    assert one_line(result).startswith(f"error: {config}: parallelism_config.{key}: "), result


@pytest.mark.parametrize("case", YAML_CASES)
def test_estimate_memory_config(yaml_files, case, capsys):
    result = bounded(tool("estimate_memory"), ["7B", "--config", yaml_files[case]], capsys=capsys)
    assert result["outcome"] == 1, result
    line = one_line(result)
    assert line.startswith("estimate_memory.py: error: accelerate config '") and YAML_PATHS[case] in line, line


@pytest.mark.parametrize("case", list(estimate_cases()))
def test_estimate_memory_numbers(case, capsys):
    result = bounded(tool("estimate_memory"), estimate_cases()[case], capsys=capsys)
    # argparse's status for a bad argument
    assert result["outcome"] == 2, result
    option, value = case.split("=", 1)
    line = one_line(result)
    assert line.startswith(f"estimate_memory.py: error: argument {option}: {value!r} is not"), line


def test_the_fake_checkpoint_is_resumable(checkpoints, capsys):
    """So that each case below is refused for its one replaced file, and nothing else."""
    result = bounded(tool("check_checkpoint"), [checkpoints["pristine"]], capsys=capsys)
    assert (
        result["outcome"] == 0 and one_line(result) == f"checkpoint-{STEP} (step {STEP}, PLAIN, 1 rank(s)): resumable"
    ), result


@pytest.mark.parametrize("case", list(checkpoint_plan()))
def test_check_checkpoint(checkpoints, case, capsys):
    result = bounded(tool("check_checkpoint"), [checkpoints[case]], capsys=capsys)
    assert result["outcome"] == 1 and not result["stderr"], result
    line = one_line(result)
    file = case.split("-")[0]
    if case == "trainer_state.json-missing":
        wanted = "missing trainer_state.json"
    elif "-global_step-" in case and type(step := WRONG_VALUES[case.rsplit("-", 1)[1]]) is int and step >= 0:
        # a step, not this folder's
        wanted = f"trainer_state.json says step {step}, the folder name step {STEP}"
    else:
        wanted = f"unreadable {file} ("
    assert line.startswith(f"checkpoint-{STEP} (") and "INCOMPLETE: " in line and wanted in line, line
    if "-world_size-" in case:
        assert "world_size" in line and "from 1 to 65536" in line, line


def finished_step_reader(ckpt: str):
    """The resume's second read of trainer_state.json (train_fsdp.py: a checkpoint at max_steps is exported, not
    trained), as a RecipeError's one line or the step it returns."""
    from types import SimpleNamespace

    from fsdp_recipes.train.export import finished_checkpoint_step

    try:
        return finished_checkpoint_step(SimpleNamespace(resume_from_checkpoint=ckpt, max_steps=STEP))
    except RecipeError as err:
        print(err)
        return "RecipeError"


@pytest.mark.parametrize("case", [c for c in checkpoint_plan() if c.startswith("trainer_state.json")])
def test_the_resumes_read_of_the_finished_step(checkpoints, case, capsys):
    """Each case as if trainer_state.json changed after the resume was decided (the decision refuses them all): a step
    number other than the folder's (checkpoint-3) too, not only a file that is no step at all."""
    assert bounded(finished_step_reader, checkpoints["pristine"], capsys=capsys)["outcome"] == STEP
    result = bounded(finished_step_reader, checkpoints[case], capsys=capsys)
    assert result["outcome"] == "RecipeError", result
    assert "trainer_state.json" in one_line(result), result


# ----- what is accepted, and the help -----


def test_in_range_numbers_are_accepted_and_help_shows_each_default_once(capsys):
    import re

    main = tool("estimate_memory")
    argv = [
        "1B",
        "--nproc-per-node",
        "1",
        "--nnodes",
        "1",
        "--micro-batch",
        "1",
        "--seq-len",
        "1",
        "--gpu-memory",
        "0.5GiB",
        "--json",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["per_gpu_bytes"]["gpu_total"] > 0
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    # one entry per option
    options = re.split(r"\n(?=  -)", text.split("\noptions:\n")[1].split("\n\n")[0])
    entries = {
        entry.split()[0].rstrip(","): " ".join(entry.split())
        for entry in options
        if not entry.lstrip().startswith("-h")
    }
    assert len(entries) == 13 and all(entry.count("(default: ") == 1 for entry in entries.values()), entries
    for option, default in (("--nproc-per-node", 8), ("--nnodes", 1), ("--micro-batch", 1), ("--seq-len", 2048)):
        assert entries[option].endswith(f"(default: {default})"), entries[option]


# ----- the class: no read of a whole file outside fsdp_recipes/bounded.py -----

# Reads of a whole file or stream that no user or other tool hands us; every other read goes through
# fsdp_recipes.bounded (a size limit, regular files only, non-blocking) or reads a stated number of bytes.
UNBOUNDED_BY_DESIGN = {
    ("fsdp_recipes/ckpt/copier.py", "sys.stdin.read()"): "the plan the merge writes into the copier's own pipe",
    (
        "fsdp_recipes/ckpt/safetensors_writer.py",
        "errors.read()",
    ): "the copier's stderr, in a temporary file the merge made",
    ("fsdp_recipes/compat/internals.py", "requirements.read_text()"): "this checkout's requirements.txt",
    (
        "fsdp_recipes/config/launcher.py",
        'Path(f"/proc/{pid}/cmdline").read_bytes()',
    ): "the kernel's record of a process",
    ("fsdp_recipes/config/launcher.py", 'Path(f"/proc/{pid}/stat").read_text()'): "the kernel's record of a process",
}


def whole_file_reads() -> dict[tuple[str, str], int]:
    """(file, call) -> line, for each call in the package, tools/ and train_fsdp.py that reads a file or stream whole:
    .read_text(), .read_bytes(), .read() without a size, .readlines(), json.load()."""
    import ast

    found = {}
    for path in sorted(
        [*(REPO / "fsdp_recipes").rglob("*.py"), *(REPO / "tools").glob("*.py"), REPO / "train_fsdp.py"]
    ):
        rel = path.relative_to(REPO).as_posix()
        if rel == "fsdp_recipes/bounded.py":
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                if (
                    name in ("read_text", "read_bytes", "readlines")
                    or (name == "read" and not node.args and not node.keywords)
                    or (name == "load" and isinstance(owner, ast.Name) and owner.id == "json")
                ):
                    found[(rel, ast.get_source_segment(source, node))] = node.lineno
    return found


def test_no_file_is_read_whole_outside_the_bounded_readers():
    found = whole_file_reads()
    # the scan sees the reads it allows
    assert len(found) >= len(UNBOUNDED_BY_DESIGN) > 0
    unbounded = {
        f"{file}:{line}: {call}" for (file, call), line in found.items() if (file, call) not in UNBOUNDED_BY_DESIGN
    }
    assert not unbounded, "read with fsdp_recipes.bounded (read_text / load_json with a limit) instead:\n" + "\n".join(
        sorted(unbounded)
    )
    assert set(UNBOUNDED_BY_DESIGN) <= set(found), "an allowed read is gone: take it off UNBOUNDED_BY_DESIGN"
