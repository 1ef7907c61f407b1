"""Every hub request this repository makes ends within its deadline, with one line: a hub that accepts the
connection and never answers stops a run before training (model, tokenizer, dataset and push checks), and fails
the upload after it with the model kept and the `hf upload` command named; it never waits forever.

Each call site is run against tests/helpers/fake_hub.py made silent on the routes it asks (it reads the request and
never answers), and against a socket that listens and never accepts, in one child process whose huggingface_hub was
imported with HF_HUB_DOWNLOAD_TIMEOUT=1 and HF_HUB_ETAG_TIMEOUT=1 (read at import): a call that hangs there is
reported as hung after WATCHDOG seconds instead of stopping the suite. The cases run at once, each silent on its own
repository's routes; tools/merge_checkpoint.py --base-model <hub id> runs in a process of its own (MERGE), timed
from its main's start. The waits huggingface_hub's retries make between attempts are added to a call's time
instead of slept (the child's hub_http.time): every attempt still meets the silent hub and its deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

# a subprocess scenario of 35 s (the library retries some requests): the full tier's, the quick tier stays within 3 min
pytestmark = pytest.mark.slow

# seconds a call may take in the child before it is reported as hung
WATCHDOG = 60
# seconds: the 1 s deadline and a loaded machine's slowness
BOUND = 15
# huggingface_hub retries these requests on a timeout, 5 times, 1, 2, 4, 8 and 8 s apart: 6 deadlines and 23 s
RETRIED = {"upload: list_repo_files", "upload: preupload"}
RETRIED_BOUND = 6 * 1 + 23 + BOUND

CHILD = r"""
import json, os, socket, subprocess, sys, threading, time
from pathlib import Path

sys.path.insert(0, sys.argv[2])
REPO = Path(sys.argv[2]).parent
from helpers.fake_hub import NotServed, serve

root = Path(sys.argv[1])
release = threading.Event()
listening = socket.socket()  # a socket that listens and never accepts
listening.bind(("127.0.0.1", 0))
listening.listen(8)


def silent(method, path, body, authorized):  # what no case's hub answers: its own repository's route
    return (
        any(name in path for name in ("model-a", "tok-b", "data-c", "model-d", "model-m"))
        or (path == "/api/whoami-v2" and not authorized)
        or path == "/api/models/tester/f"
        or (path == "/api/repos/create" and b"silent-create" in body)
        or any(path.startswith(f"/api/models/tester/{r}/{route}/") for r, route in SILENT_ROUTES)
    )


SILENT_ROUTES = [("h", "branch"), ("i", "tree"), ("j", "preupload"), ("k", "commit")]

with serve(root / "hub") as hub:
    os.environ.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.token)
    answer = hub.handle

    def handle(method, path, query, body, authorized):
        if silent(method, path, body, authorized):  # the request is read; no answer ever comes
            release.wait()
            raise NotServed
        return answer(method, path, query, body, authorized)

    hub.handle = handle
    import huggingface_hub.constants
    import huggingface_hub.utils._http as hub_http

    waits = threading.local()  # .seconds: what huggingface_hub's retries waited in this thread, counted, not slept

    class CountedWaits:  # 23 s of waits (1, 2, 4, 8, 8) per retried request: added to its time, not spent
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            waits.seconds = getattr(waits, "seconds", 0.0) + seconds

    hub_http.time = CountedWaits()

    from fsdp_recipes.config.hub_push import HubPush, access_problem
    from fsdp_recipes.config.model_source import dataset_source_problem, hub_config_problem, hub_problem
    from fsdp_recipes.errors import RecipeError
    from fsdp_recipes.train.upload import upload_final_model

    out = root / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")

    def upload(push):
        try:
            upload_final_model(push, str(out), step=2, log=lambda line: None)
        except RecipeError as err:
            return str(err)
        return "uploaded"

    def never_accepting():
        huggingface_hub.constants.ENDPOINT = f"http://127.0.0.1:{listening.getsockname()[1]}"
        return access_problem(HubPush("tester/l"), "WAY ROUND")

    cases = {
        "model config (file_exists)": lambda: hub_problem("tester/model-a", "config.json"),
        "tokenizer repository (repo_exists)": lambda: hub_problem("tester/tok-b", None),
        "dataset (repo_exists)": lambda: dataset_source_problem("tester/data-c"),
        "tools' model config": lambda: "; ".join(hub_config_problem("tester/model-d") or ()),
        "push: whoami": lambda: access_problem(HubPush("tester/e", token="hf_silent"), "WAY ROUND"),
        "push private: repo_info": lambda: access_problem(HubPush("tester/f", private=True), "WAY ROUND"),
        "upload: create_repo": lambda: upload(HubPush("tester/silent-create")),
        "upload: create_branch": lambda: upload(HubPush("tester/h", revision="run-1")),
        "upload: list_repo_files": lambda: upload(HubPush("tester/i")),
        "upload: preupload": lambda: upload(HubPush("tester/j")),
        "upload: commit": lambda: upload(HubPush("tester/k")),
    }
    results = {}

    def timed(name, call):
        start = time.monotonic()
        said = call()
        waited = getattr(waits, "seconds", 0.0)
        results[name] = {"seconds": time.monotonic() - start + waited, "waited": waited, "said": said}

    def watched(cases):  # at once; a call still waiting after the watchdog's seconds is left out, as hung
        workers = [threading.Thread(target=timed, args=case, daemon=True) for case in cases.items()]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + float(sys.argv[3])
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def merge(name, repo_id):  # the tool in a process of its own (its main takes SIGTERM), timed there
        try:
            proc = subprocess.run(
                [sys.executable, "-c", sys.argv[4], str(REPO), str(root), repo_id],
                capture_output=True,
                text=True,
                timeout=2 * float(sys.argv[3]),  # its start (torch, transformers) included
            )
        except subprocess.TimeoutExpired:  # left out, as hung
            return
        lines = proc.stdout.strip().splitlines()
        results[name] = json.loads(lines[-1]) if lines else {"seconds": 0, "said": proc.stderr[-3000:]}

    merging = threading.Thread(target=merge, args=("merge: --base-model hub id", "tester/model-m"), daemon=True)
    merging.start()
    watched(cases)
    watched({"push: whoami, a socket that never accepts": never_accepting})  # the endpoint changed: this one alone
    merging.join()
    release.set()
print(json.dumps(results))
"""

MERGE = r"""
import contextlib, importlib.util, io, json, sys, time
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

repo, root = Path(sys.argv[1]), Path(sys.argv[2])
ckpt = root / "weights-only"  # a checkpoint of weights alone: the merge reads its config from --base-model
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(repo / "assets" / "tiny-llama")).save_pretrained(ckpt)
for name in ("config.json", "generation_config.json"):
    (ckpt / name).unlink()
spec = importlib.util.spec_from_file_location("merge_checkpoint", repo / "tools" / "merge_checkpoint.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
said = io.StringIO()
start = time.monotonic()
with contextlib.redirect_stderr(said):
    code = tool.main([str(ckpt), str(root / "merged"), "--base-model", sys.argv[3]])
print(json.dumps({"seconds": time.monotonic() - start, "said": said.getvalue().strip() if code else "merged"}))
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("silent_hub")
    env = {
        **os.environ,
        "HF_HUB_DOWNLOAD_TIMEOUT": "1",
        "HF_HUB_ETAG_TIMEOUT": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(root / "hf_home"),
        "NO_PROXY": "127.0.0.1",
    }
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(REPO / "tests"), str(WATCHDOG), MERGE],
        capture_output=True,
        text=True,
        env=env,
        timeout=WATCHDOG * 4,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = [
    "model config (file_exists)",
    "tokenizer repository (repo_exists)",
    "dataset (repo_exists)",
    "tools' model config",
    "push: whoami",
    "push private: repo_info",
    "push: whoami, a socket that never accepts",
    "upload: create_repo",
    "upload: create_branch",
    "upload: list_repo_files",
    "upload: preupload",
    "upload: commit",
    "merge: --base-model hub id",
]


@pytest.mark.parametrize("case", CASES)
def test_a_hub_that_never_answers_ends_each_call_in_time_with_one_line(outcomes, case):
    assert case in outcomes, f"{case}: still waiting for the hub after {WATCHDOG} s"
    seconds, said = outcomes[case]["seconds"], outcomes[case]["said"]
    assert seconds < (RETRIED_BOUND if case in RETRIED else BOUND), f"{case}: {seconds:.1f} s, {outcomes[case]}"
    assert "\n" not in said and "no answer within the deadline" in said and "HF_HUB_DOWNLOAD_TIMEOUT" in said, said
    # after training: the model is kept, and the command that uploads it is named
    if case.startswith("upload"):
        assert said.startswith("the model is saved, but its upload to tester/") and "`hf upload tester/" in said, said
    # before training: stopped, with the way round
    elif case.startswith("push"):
        assert said.startswith("the hub cannot be reached (") and "WAY ROUND" in said, said
    else:
        assert "the hub cannot be reached (" in said and "HF_HUB_OFFLINE=1" in said, said
