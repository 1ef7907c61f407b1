"""Shared helpers: real `accelerate launch` runs of train_fsdp.py on CPU, one at a time."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE
from fsdp_recipes.config.strategy import strategy_of
from fsdp_recipes.removal import MARKER, make_folder

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
CONFIG_DIR = REPO / "accelerate_configs"
ALL_CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in CONFIG_DIR.rglob("*.yaml"))
# DDP, and ZeRO-1 with --zero1 true: no fsdp_config
DDP_CONFIG = "accelerate_configs/ddp.yaml"
FSDP_CONFIGS = [c for c in ALL_CONFIGS if c != DDP_CONFIG]
# Fast test settings on top of the default recipe: enough steps for the loss to fall, one mid-run checkpoint.
QUICK = [
    "--max_steps",
    "12",
    "--save_steps",
    "6",
    "--logging_steps",
    "2",
    "--warmup_steps",
    "2",
    "--save_total_limit",
    "3",
]


def quick(**changes: str) -> list[str]:
    """QUICK with some values changed: train_fsdp.py refuses a flag given twice with different values."""
    flags = dict(zip(QUICK[::2], QUICK[1::2]))
    flags.update({f"--{name}": value for name, value in changes.items()})
    return [item for pair in flags.items() for item in pair]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_process_group(monkeypatch):
    """torch.distributed initialised in this process alone (gloo, rank 0 of 1), for units that call collectives."""
    import torch.distributed as dist

    # undone after the test: launches elsewhere must not inherit them
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run(
    cmd: list[str], cwd: Path = REPO, timeout: int = 600, env: dict | None = None, new_session: bool = False
) -> subprocess.CompletedProcess:
    """``new_session``: the command gets a process group of its own (a signal to that group spares pytest).

    PYTHONPATH starts with this checkout: `python tools/x.py` puts tools/, not the repository, first on sys.path,
    and would otherwise import whichever fsdp_recipes is installed (an editable install of another checkout)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": path,
        **(env or {}),
    }
    launches = (
        Path(cmd[0]).name == "torchrun"
        or cmd[:2] == ["accelerate", "launch"]
        or "accelerate.commands.launch" in cmd[:3]
    )
    if launches and CURRENT_TEST.get("slow") is False:
        pytest.fail(
            "this test launches a run: mark it @pytest.mark.slow (the quick tier, -m 'not slow', has no launches)"
        )
    start = time.monotonic()
    try:
        return subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env, start_new_session=new_session
        )
    finally:
        took = time.monotonic() - start
        kind = "multi-process launch" if launches else _kind(cmd)
        count, seconds = SUBPROCESSES.get(kind, (0, 0.0))
        SUBPROCESSES[kind] = (count + 1, seconds + took)
        if launches:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
            count, seconds = LAUNCHES.get(test, (0, 0.0))
            LAUNCHES[test] = (count + 1, seconds + took)


def _kind(cmd: list[str]) -> str:
    """What a command runs, for the summary: the script or module a python runs (each pays its imports again)."""
    name = Path(cmd[0]).name
    if not name.startswith("python") or len(cmd) < 2:
        return name if name != "bash" else "bash: " + " ".join(cmd[-1].split()[:2])
    if cmd[1] == "-m":
        return " ".join(cmd[1:3])
    return "python -c" if cmd[1] == "-c" else str(cmd[1]).replace(f"{REPO}/", "")


# test -> (multi-process launches, their seconds): the suite's time is mostly these (each pays ~7 s of imports and
# start-up before its first step); the summary lists the tests that launch most, so that new ones share runs
LAUNCHES: dict[str, tuple[int, float]] = {}
# what each kind of command run through run() costs in all: the tools' own imports are paid per call as well
SUBPROCESSES: dict[str, tuple[int, float]] = {}


def pytest_sessionfinish(session):
    """An xdist worker hands its counts to the controller, which sums them for the summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["launch_counts"] = json.dumps([LAUNCHES, SUBPROCESSES])


def pytest_testnodedown(node, error):
    counts = getattr(node, "workeroutput", {}).get("launch_counts")
    for theirs, ours in zip(json.loads(counts) if counts else (), (LAUNCHES, SUBPROCESSES)):
        for key, (count, seconds) in theirs.items():
            mine = ours.get(key, (0, 0.0))
            ours[key] = (mine[0] + count, mine[1] + seconds)


def pytest_terminal_summary(terminalreporter):
    if not LAUNCHES:
        return
    count, seconds = sum(c for c, _ in LAUNCHES.values()), sum(s for _, s in LAUNCHES.values())
    terminalreporter.section(f"multi-process launches: {count}, {seconds:.0f} s")
    for test, (n, s) in sorted(LAUNCHES.items(), key=lambda item: -item[1][1])[:15]:
        terminalreporter.write_line(f"{s:7.1f} s {n:3d} launch(es)  {test}")
    count, seconds = sum(c for c, _ in SUBPROCESSES.values()), sum(s for _, s in SUBPROCESSES.values())
    terminalreporter.section(f"commands run by the tests: {count}, {seconds:.0f} s")
    for kind, (n, s) in sorted(SUBPROCESSES.items(), key=lambda item: -item[1][1])[:12]:
        terminalreporter.write_line(f"{s:7.1f} s {n:4d} x  {kind}")


# train_fsdp.py with a SIGKILL injected at a chosen point (FSDP_FAULT), for the fault-tolerance tests.
FAULT_SCRIPT = REPO / "tests" / "helpers" / "train_with_fault.py"


def launch(
    config: str,
    *script_args: str,
    launch_args: tuple[str, ...] = (),
    cwd: Path = REPO,
    check: bool = True,
    script: Path = REPO / "train_fsdp.py",
    env: dict | None = None,
    new_session: bool = False,
):
    """`accelerate launch --config_file CONFIG [launch_args] train_fsdp.py [script_args]`, on a free port (29500,
    torchrun's default, would make two test suites on one machine collide).

    Run as `python -m accelerate.commands.launch`: the same parser and launch_command as the `accelerate launch`
    command, without importing the CLI's seven other commands first (about 1.3 s per launch on the 2-core machine,
    before any rank starts). The `accelerate launch` command itself runs in test_readme, test_arguments and
    test_check_config; fsdp_recipes.config.launcher finds the config in force from either."""
    port = () if "--main_process_port" in launch_args else ("--main_process_port", str(free_port()))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / config),
        *port,
        *launch_args,
        str(script),
        *script_args,
    ]
    proc = run(cmd, cwd=cwd, env=env, new_session=new_session)
    if check and proc.returncode != 0:
        pytest.fail(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n--- stderr tail ---\n{proc.stderr[-6000:]}")
    return proc


def o_direct_here(folder: Path) -> bool:
    """Whether files in ``folder`` open with O_DIRECT (checkpoint shards are written so where they do)."""
    if not getattr(os, "O_DIRECT", 0):
        return False
    try:
        os.close(os.open(folder / ".o_direct_probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        return False
    os.unlink(folder / ".o_direct_probe")
    return True


def shard_files_written(count: int, folder: Path) -> dict:
    """fsdp_report.json's checkpoint_writes.shard_files for ``count`` shard files written in ``folder``."""
    if o_direct_here(folder):
        return {"direct": count, "page_cache": 0}
    return {"direct": 0, "page_cache": count, "page_cache_why": "the filesystem refused open(O_DIRECT)"}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def logged_losses(output_dir: Path) -> list[float]:
    history = read_json(output_dir / "trainer_state.json")["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def header_dtypes(path: Path) -> set[str]:
    """The dtypes a safetensors file's header gives its tensors ("F32", "BF16", ...)."""
    import struct

    raw = Path(path).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return {v["dtype"] for k, v in json.loads(raw[8 : 8 + size]).items() if k != "__metadata__"}


def rewrite_weights(folder: Path, edit) -> None:
    """Apply ``edit`` to the tensors of ``folder``/model.safetensors in place and write them back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def same_tensors(a: Path, b: Path) -> None:
    """The safetensors files ``a`` and ``b`` hold the same tensor names, each bit for bit equal."""
    import torch
    from safetensors.torch import load_file

    mine, theirs = load_file(a), load_file(b)
    assert set(mine) == set(theirs), sorted(set(mine) ^ set(theirs))[:5]
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), (a, key)


# The FSDP2 HSDP config is multi-node; on one machine it runs as 2 replicas x 2 shards = 4 processes.
LAUNCH_OVERRIDES = {
    "accelerate_configs/hybrid_shard.yaml": (
        "--num_machines",
        "1",
        "--num_processes",
        "4",
        "--parallelism_config_dp_replicate_size",
        "2",
        "--parallelism_config_dp_shard_size",
        "2",
    ),
}


@dataclass
class Run:
    config: str
    output_dir: Path
    world_size: int
    # None: DDP
    fsdp_version: int | None
    # processes one parameter is split over
    shard_group: int
    # what the launch printed: tests of its lines share the run instead of launching their own
    stdout: str = ""
    stderr: str = ""

    @property
    def model_dir(self) -> Path:
        """The run's final model, in a folder of its own."""
        return self.output_dir / "model"

    @property
    def report(self) -> dict:
        return read_json(self.output_dir / "fsdp_report.json")


def expected_layout(config: str) -> tuple[int, int, int]:
    """(world size, fsdp_version, shard group size) that the config should produce on this CPU machine."""
    cfg = yaml.safe_load((REPO / config).read_text())
    strategy = strategy_of(cfg)
    # DDP: every rank holds everything
    if strategy.fsdp_version is None:
        return cfg["num_processes"], None, 1
    overrides = LAUNCH_OVERRIDES.get(config, ())
    world = int(overrides[overrides.index("--num_processes") + 1]) if overrides else cfg["num_processes"]
    if strategy.fsdp_version == 2:
        shard = int(overrides[overrides.index("--parallelism_config_dp_shard_size") + 1]) if overrides else world
    else:
        # NO_SHARD keeps everything; FSDP1 HYBRID_SHARD shards within the node (on CPU, its processes: cpu_fsdp)
        shard = 1 if strategy.name == "NO_SHARD" else world
    return world, strategy.fsdp_version, shard


# The hub environment every test and every command it runs sees, whatever the shell that started pytest set: an
# empty HF_HOME (no cached model, dataset, token or accelerate default config of the user's), online, and a hub
# endpoint that refuses connections at once (a hub id not mocked is "the hub cannot be reached", with or without a
# network). huggingface_hub, transformers and datasets read these at import, so they are set before any test module
# is imported; a test of offline behaviour sets HF_HUB_OFFLINE (or patches huggingface_hub.constants) itself.
HUB_ENVIRONMENT = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
HUB_VARIABLES_CLEARED = (
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "HF_ASSETS_CACHE",
    "HF_XET_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
)


_CLOSED: list = []


def closed_port_url() -> str:
    """http://127.0.0.1:<port> where nothing listens: a request there is refused at once. The port stays bound (never
    listening) for the whole session, so no later launch can take it and make a stray hub call hang."""
    import socket

    if not _CLOSED:
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        _CLOSED.append(held)
    return f"http://127.0.0.1:{_CLOSED[0].getsockname()[1]}"


HF_HOME_KEY = pytest.StashKey[Path]()


def pytest_configure(config):
    import tempfile

    imported = [name for name in ("huggingface_hub", "transformers", "datasets") if name in sys.modules]
    assert not imported, f"{imported} imported before the suite set the hub environment: keep them out of conftest"
    home = Path(tempfile.mkdtemp(prefix="hf_home-"))
    config.stash[HF_HOME_KEY] = home
    for name in HUB_VARIABLES_CLEARED:
        os.environ.pop(name, None)
    os.environ.update(HUB_ENVIRONMENT, HF_HOME=str(home), HF_ENDPOINT=closed_port_url())


def pytest_unconfigure(config):
    if home := config.stash.get(HF_HOME_KEY, None):
        shutil.rmtree(home, ignore_errors=True)


# Tests that launch real multi-process runs (directly or through these fixtures) are the slow tier;
# `python -m pytest -q -m "not slow" tests` is the quick one, for development.
SLOW_FIXTURES = {"trained", "corpus", "lora_recipe_run"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# whether the test running now is in the slow tier (launch() refuses otherwise)
CURRENT_TEST: dict[str, bool] = {}


def pytest_runtest_setup(item):
    CURRENT_TEST["slow"] = item.get_closest_marker("slow") is not None


def shared_temp(tmp_path_factory) -> Path:
    """The session's temporary folder, the same for every pytest-xdist worker (each worker's own basetemp is
    <session's basetemp>/popen-gwN)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Launch each (config, extra arguments) once per session with QUICK settings; tests share the result, across
    pytest-xdist's workers too: the first worker to need a run launches it under a file lock, the others read it."""
    from filelock import FileLock

    shared = shared_temp(tmp_path_factory)
    runs: dict[tuple, Run] = {}

    def get(config: str, *script_args: str, launch_args: tuple[str, ...] = ()) -> Run:
        key = (config, script_args, launch_args)
        if key in runs:
            return runs[key]
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        out, done = shared / f"trained-{name}", shared / f"trained-{name}.json"
        with FileLock(shared / f"trained-{name}.lock"):
            if not done.is_file():
                proc = launch(
                    config,
                    *QUICK,
                    *script_args,
                    "--output_dir",
                    str(out),
                    launch_args=LAUNCH_OVERRIDES.get(config, ()) + launch_args,
                )
                done.write_text(json.dumps({"stdout": proc.stdout, "stderr": proc.stderr}))
        printed = read_json(done)
        runs[key] = Run(config, out, *expected_layout(config), stdout=printed["stdout"], stderr=printed["stderr"])
        return runs[key]

    return get


@pytest.fixture(scope="session")
def lora_recipe_run(tmp_path_factory) -> Path:
    """recipes/tiny-llama/lora_sft.yaml launched on zero3.yaml as a new user would, from a fresh checkout (assets/ and
    recipes/, no runs/), for 4 steps with checkpoints 2 and 4: the folder it ran in (the run is runs/tiny-llama-lora
    there, its base built from a config and saved once in runs/tiny-llama-lora/base_model). Shared by every test of
    the recipe and across xdist workers: tests copy what they change (lora_recipe_copy)."""
    from filelock import FileLock

    root = shared_temp(tmp_path_factory) / "lora-recipe"
    with FileLock(f"{root}.lock"):
        if not (root / "runs" / "tiny-llama-lora" / "model").is_dir():
            shutil.rmtree(root, ignore_errors=True)
            for folder in ("assets", "recipes"):
                shutil.copytree(REPO / folder, root / folder)
            launch("accelerate_configs/zero3.yaml", LORA_RECIPE, "--max_steps", "4", "--save_steps", "2", cwd=root)
    return root


LORA_RECIPE = "recipes/tiny-llama/lora_sft.yaml"


def lora_recipe_copy(root: Path, to: Path) -> Path:
    """A private copy of lora_recipe_run's run folder at ``to`` (no lock file): a resume of it names ``to`` as
    --output_dir."""
    shutil.copytree(root / "runs" / "tiny-llama-lora", to, ignore=shutil.ignore_patterns(".run.lock*"))
    return to


@pytest.fixture(scope="session")
def gpt2_run(trained, tmp_path_factory) -> Run:
    """GPT-2 from a tiny config (2 GPT2Blocks, input and output embeddings tied) on zero3.yaml with QUICK settings:
    a second architecture, and the tied case, for the training and merge tests."""
    from filelock import FileLock
    from transformers import AutoTokenizer, GPT2Config

    tokenizer = REPO / "assets" / "tiny-llama"
    # one path for every xdist worker: one launch
    config_dir = shared_temp(tmp_path_factory) / "tiny-gpt2"
    with FileLock(f"{config_dir}.lock"):
        if not config_dir.is_dir():
            GPT2Config(
                vocab_size=len(AutoTokenizer.from_pretrained(tokenizer)),
                n_positions=128,
                n_embd=64,
                n_layer=2,
                n_head=4,
                tie_word_embeddings=True,
            ).save_pretrained(config_dir)
    return trained(
        "accelerate_configs/zero3.yaml",
        "--config_name",
        str(config_dir),
        "--tokenizer_name",
        str(tokenizer),
        "--block_size",
        "64",
        "--learning_rate",
        "3e-3",
    )


def make_special(path: Path, kind: str) -> None:
    """Put at ``path`` what a hostile or careless user leaves where a file is read: "fifo" (blocks the first read),
    "dev_zero" (a link to a device that never ends), "folder", "broken_link", "missing"; what was there goes first."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind in ("dev_zero", "link_to_dev_zero"):
        path.symlink_to("/dev/zero")
    elif kind in ("folder", "directory"):
        path.mkdir()
    elif kind == "broken_link":
        path.symlink_to(path.parent / f"{path.name}.gone")
    elif kind != "missing":
        raise ValueError(kind)


# Helpers shared by the checkpoint tests.


def elastic_root_cause(stderr: str) -> str:
    """The message torch elastic's failure report gives as the root cause (its report's last text line)."""
    report = stderr.split("Root Cause (first observed failure):", 1)[1]
    return (
        [line for line in report.splitlines() if line.strip().startswith("traceback :")][0]
        .split("traceback :", 1)[1]
        .strip()
    )


def fail_direct_writes(monkeypatch, first: int, code: int) -> None:
    """fsdp_recipes.direct_writes' ``first``-th write to disk (os.pwrite) and every one after it fail with ``code``,
    as a full disk (ENOSPC), a full quota (EDQUOT) or a failing device (EIO) fails them."""
    from fsdp_recipes import direct_writes

    calls, pwrite = [], os.pwrite

    def fails_once_reached(fd, data, offset):
        calls.append(offset)
        if len(calls) >= first:
            raise OSError(code, os.strerror(code))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(direct_writes.os, "pwrite", fails_once_reached)


def plain_checkpoint(folder: Path, step: int, world: int) -> Path:
    """A complete checkpoint of a run without FSDP over ``world`` processes, written by hand: one RNG file per rank."""
    import torch
    from safetensors.torch import save_file

    ckpt = folder / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    save_file({"weight": torch.zeros(2)}, ckpt / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    for rank in range(world):
        torch.save({"python": [rank], "numpy": [rank], "cpu": torch.zeros(2)}, ckpt / f"rng_state_{rank}.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (ckpt / "fsdp_report.json").write_text(
        json.dumps({"fsdp_version": None, "world_size": world, "sharding_strategy": None})
    )
    return ckpt


def _model_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        (path / name).write_text("{}")
    return path


def _home(p):
    p.mkdir()
    (p / ".bashrc").write_text("x")
    (p / ".ssh").mkdir()
    (p / ".ssh" / "id_rsa").write_text("k")
    (p / "projects").mkdir()


def _notes(p):
    p.mkdir()
    (p / "notes.txt").write_text("mine")
    (p / "data").mkdir()


def _model_plus_notes(p):
    _model_folder(p)
    (p / "notes.txt").write_text("mine")


def _model_with_folder(p):
    _model_folder(p)
    (p / "data").mkdir()
    (p / "data" / "x.jsonl").write_text("{}")


def _link_to_model(p):
    target = _model_folder(p.parent / f"{p.name}-target")
    p.symlink_to(target)


def _model_with_link(p):
    _model_folder(p)
    (p / "tokenizer_config.json").symlink_to(p.parent)


def _forged_marker(p):
    _notes(p)
    (p / MARKER).write_text('{"tool": "someone-else"}')


FOREIGN = {
    "home": _home,
    "notes": _notes,
    "model+notes": _model_plus_notes,
    "model+data/": _model_with_folder,
    "link to a model": _link_to_model,
    "model with a link": _model_with_link,
    "forged marker": _forged_marker,
}


def _snapshot(path: Path) -> list[str]:
    if path.is_symlink():
        return ["link -> " + os.readlink(path)]
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _checkpoint(path: Path, marked: bool) -> Path:
    if marked:
        make_folder(path, CHECKPOINT_PURPOSE)
    else:
        path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": int(path.name.split("-")[-1])}))
    (path / "pytorch_model_fsdp_0").mkdir()
    (path / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"x")
    return path


def cli(tool: str, argv: list[str]) -> int:
    """A tool's main(argv) in this process: its exit code (argparse's exit, a SystemExit, returned as its code)."""
    spec = importlib.util.spec_from_file_location(f"{tool}_cli", TOOLS / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """A private copy of a real 2-rank FSDP2 run's newest checkpoint."""
    copy = tmp_path / "run"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", copy / "checkpoint-12")
    return copy


def one_line_error(text: str, prefix: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), text
    return lines[0]
