"""tests/helpers/fake_hub.py against the real huggingface_hub client, run in a subprocess because the client reads
HF_ENDPOINT once, at import: whoami, create_repo, create_branch, upload_folder / create_commit, and the refusals."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO
from helpers.fake_hub import MAX_BODY, serve

HELPER = REPO / "tests" / "helpers" / "fake_hub.py"


@pytest.fixture
def hub(tmp_path):
    with serve(tmp_path / "hub") as running:
        yield running


def client(hub, code: str, token: str | None = None):
    """Run `code` with `api` (an HfApi) defined and return what it prints as JSON."""
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": token or hub.token,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # the suite may run offline, which the client enforces even for a local endpoint
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
        "HF_HOME": str(hub.root.parent / "hf_home"),
    }
    prologue = (
        "import json\nfrom huggingface_hub import HfApi, CommitOperationAdd, CommitOperationDelete\napi = HfApi()\n"
    )
    proc = subprocess.run([sys.executable, "-c", prologue + code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refusals(*calls: str) -> str:
    """Code printing, for each call, the class, status and message of the HfHubHTTPError it raises (None if none)."""
    return (
        "from huggingface_hub.errors import HfHubHTTPError\nout = []\n"
        + "".join(
            f"""
try:
    {call}
    out.append(None)
except HfHubHTTPError as err:
    out.append([type(err).__name__, err.response.status_code, str(err)])
"""
            for call in calls
        )
        + "print(json.dumps(out))"
    )


def test_whoami(hub):
    me = client(hub, "print(json.dumps(api.whoami()))")
    assert me["name"] == "tester" and [o["name"] for o in me["orgs"]] == ["test-org"]
    assert me["auth"]["accessToken"]["role"] == "write"
    assert hub.requests == [("GET", "/api/whoami-v2")]


def test_upload_folder_stores_identical_files(hub, tmp_path):
    folder = tmp_path / "model"
    # README: the client has it validated
    files = {
        "config.json": b'{"a": 1}\n',
        "model.safetensors": os.urandom(5000),
        "sub/deeper/notes.txt": b"nested\n",
        "empty.txt": b"",
        "README.md": b"---\nlicense: mit\n---\n# tiny\n",
    }
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    out = client(
        hub,
        f"""
first = api.create_repo("test-org/tiny", private=True, exist_ok=True)
again = api.create_repo("test-org/tiny", private=True, exist_ok=True)  # a 409, which exist_ok takes
commit = api.upload_folder(repo_id=first.repo_id, folder_path={str(folder)!r})
print(json.dumps([first.repo_id, again.repo_id, commit.commit_url, commit.oid]))
""",
    )
    assert out[:2] == ["test-org/tiny", "test-org/tiny"] and out[2] == f"{hub.url}/test-org/tiny/commit/{out[3]}"
    stored = hub.repo_folder("test-org/tiny")
    assert {p.relative_to(stored).as_posix(): p.read_bytes() for p in stored.rglob("*") if p.is_file()} == files
    assert hub.repos == {"test-org/tiny": {"private": True}}
    assert hub.unhandled == []


def test_branch_commit_and_deletions(hub):
    out = client(
        hub,
        """
repo = api.create_repo("tiny", exist_ok=True)  # no namespace: the user's
api.upload_file(repo_id=repo.repo_id, path_or_fileobj=b"on main", path_in_repo="keep/a.txt")
api.create_branch(repo.repo_id, branch="run/1", exist_ok=True)
api.create_branch(repo.repo_id, branch="run/1", exist_ok=True)  # a 409, which exist_ok takes
operations = [CommitOperationAdd("b.txt", b"on the branch"), CommitOperationDelete("keep/")]
commit = api.create_commit(repo.repo_id, operations, revision="run/1", commit_message="m")
print(json.dumps(repo.repo_id))
""",
    )
    assert out == "tester/tiny"
    main, branch = hub.repo_folder("tester/tiny"), hub.repo_folder("tester/tiny", "run/1")
    assert (main / "keep/a.txt").read_bytes() == b"on main" and not (main / "b.txt").exists()
    assert (
        sorted(p.name for p in branch.rglob("*")) == ["b.txt"] and (branch / "b.txt").read_bytes() == b"on the branch"
    )
    assert hub.unhandled == []


def test_wrong_token_gets_401(hub):
    (hub.root / "tester/tiny/main").mkdir(parents=True)
    whoami, upload = client(
        hub,
        refusals("api.whoami()", 'api.upload_file(repo_id="tester/tiny", path_or_fileobj=b"x", path_in_repo="x")'),
        token="hf_wrong",
    )
    assert whoami[:2] == ["HfHubHTTPError", 401] and "Invalid user token" in whoami[2]
    # refused at preupload, before any commit
    assert upload[:2] == ["HfHubHTTPError", 401] and "Invalid credentials" in upload[2]
    assert list((hub.root / "tester/tiny/main").iterdir()) == []


def test_foreign_namespace_gets_403(hub):
    [(name, status, message)] = client(hub, refusals('api.create_repo("someone-else/tiny", exist_ok=True)'))
    assert (name, status) == ("HfHubHTTPError", 403) and "someone-else" in message
    assert not (hub.root / "someone-else").exists()
    # with exist_ok the client asks repo_info whether the repository is there anyway: it is not (404)
    assert ("GET", "/api/models/someone-else/tiny") in hub.requests and hub.unhandled == []


def raw(hub, path: str, headers: dict, body: bytes = b"", method: str = "POST") -> tuple[int, dict]:
    """http.client's own request() would add the Content-Length that these tests leave out."""
    conn = http.client.HTTPConnection("127.0.0.1", int(hub.url.rsplit(":", 1)[1]), timeout=10)
    conn.putrequest(method, path)
    for key, value in {"Authorization": f"Bearer {hub.token}", **headers}.items():
        conn.putheader(key, value)
    conn.endheaders(body)
    response = conn.getresponse()
    answer = (response.status, json.loads(response.read()))
    conn.close()
    return answer


def test_bodies_are_bounded_and_paths_stay_inside(hub):
    # no Content-Length
    assert raw(hub, "/api/repos/create", {})[0] == 411
    # not read at all
    assert raw(hub, "/api/repos/create", {"Content-Length": str(MAX_BODY + 1)})[0] == 413
    body = json.dumps({"name": "tiny"}).encode()
    assert raw(hub, "/api/repos/create", {"Content-Length": str(len(body))}, body)[0] == 200
    for bad in ("../escape.txt", "/etc/x", "a/../../b", ".git/config"):
        lines = [
            {"key": "header", "value": {"summary": "s"}},
            {"key": "file", "value": {"path": bad, "content": "eA==", "encoding": "base64"}},
        ]
        body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        status, answer = raw(hub, "/api/models/tester/tiny/commit/main", {"Content-Length": str(len(body))}, body)
        assert status == 400, (bad, answer)
    assert sorted(p.relative_to(hub.root).as_posix() for p in hub.root.rglob("*")) == [
        "tester",
        "tester/tiny",
        "tester/tiny/main",
    ]
    # an unknown path is recorded even without a token (the client asks some, e.g. /api/agent-harnesses, without one)
    assert raw(hub, "/api/agent-harnesses", {"Authorization": ""}, method="GET")[0] == 404
    assert raw(hub, "/api/whoami-v2", {"Authorization": ""}, method="GET")[0] == 401
    assert hub.unhandled == [("GET", "/api/agent-harnesses")]


def test_script_mode_writes_its_url(tmp_path):
    port_file = tmp_path / "url"
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), "--root", str(tmp_path / "hub"), "--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the fake hub did not start"
            time.sleep(0.05)
        url = port_file.read_text()
        assert proc.stdout.readline().strip() == url
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
        conn.request("GET", "/api/whoami-v2", headers={"Authorization": "Bearer hf_fake_write_token"})
        assert json.loads(conn.getresponse().read())["name"] == "tester"
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
