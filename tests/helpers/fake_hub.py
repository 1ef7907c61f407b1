"""A local stand-in for the Hugging Face Hub endpoints an upload uses (whoami, create_repo, create_branch,
repo_info, list_repo_files, and the validate-yaml, preupload and commit of create_commit / upload_folder), for the real
huggingface_hub client: give the client process HF_ENDPOINT=<url> before it imports huggingface_hub, which reads the
variable at import.

A model repository is a folder, <root>/<namespace>/<name>/<branch, URL-quoted>/<files>. Preupload answers "regular"
for every file, so its bytes come base64 inside the commit and no LFS or Xet transfer is ever tried. Anything else
gets a 404 and lands in `.unhandled`: a test sees what the client asked that this fake does not know.

    python tests/helpers/fake_hub.py --root DIR --port-file FILE   # writes its URL to FILE, serves until killed
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote, urlsplit

MAX_BODY = 64 << 20
NAME = r"[A-Za-z0-9][\w.-]*"
SIMPLE = {("GET", "/api/whoami-v2"), ("POST", "/api/repos/create"), ("POST", "/api/validate-yaml")}
REPO_ROUTE = re.compile(rf"/api/models/({NAME}/{NAME})/(preupload|commit|branch)/([^/]+)")
# repo_info: does it exist, is it private
INFO_ROUTE = re.compile(rf"/api/models/({NAME}/{NAME})")
# list_repo_files: the whole branch, recursive
TREE_ROUTE = re.compile(rf"/api/models/({NAME}/{NAME})/tree/([^/]+)")
# the real hub's words, in X-Error-Message too: hf_raise_for_status takes a 401 on an (https) repository URL for
# RepositoryNotFoundError unless that header says this
BAD_TOKEN = "Invalid credentials in Authorization header"


class NotServed(Exception):
    """A request this fake does not implement."""


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


def _safe_part(text: str) -> str:
    if text in ("", ".", "..") or "\\" in text or "\0" in text:
        raise HubError(400, f"invalid path component {text!r}")
    return text


def _json(body: bytes) -> dict:
    try:
        value = json.loads(body or b"{}")
    except ValueError as err:
        raise HubError(400, f"body is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise HubError(400, "body must be a JSON object")
    return value


class FakeHub:
    def __init__(self, root: Path, token: str, user: str, orgs, role: str, scoped: list | None = None):
        self.root, self.token, self.user, self.orgs, self.role = Path(root), token, user, tuple(orgs), role
        self.scoped = scoped
        self.url = ""
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        # repo_id -> {"private": bool}, for the repos this server created
        self.repos: dict[str, dict] = {}
        # the server is threaded: commits and branch copies touch the same folders
        self._lock = threading.Lock()

    def repo_folder(self, repo_id: str, revision: str = "main") -> Path:
        # one folder per branch, its name quoted: branch "a/b" must not land among branch "a"'s files
        return self._repo(repo_id) / _safe_part(quote(revision, safe=""))

    def _repo(self, repo_id: str) -> Path:
        return self.root.joinpath(*repo_id.split("/"))

    def handle(self, method: str, path: str, query: str, body: bytes, authorized: bool) -> dict:
        if method == "GET" and (tree := TREE_ROUTE.fullmatch(path)):
            if not authorized:
                raise HubError(401, BAD_TOKEN)
            return self.tree(tree.group(1), unquote(tree.group(2)))
        if method == "GET" and (info := INFO_ROUTE.fullmatch(path)):
            if not authorized:
                raise HubError(401, BAD_TOKEN)
            if not self._repo(info.group(1)).is_dir():
                raise HubError(404, f"Repository not found: {info.group(1)}", "RepoNotFound")
            private = self.repos.get(info.group(1), {}).get("private", False)
            return {"id": info.group(1), "private": private, "sha": "0" * 40, "siblings": []}
        route = REPO_ROUTE.fullmatch(path) if method == "POST" else None
        # create_pr needs pull-request refs: unknown here, rather than committed to the branch by mistake.
        # Unknown comes before the token check, so that what the client asks without a token is recorded too.
        if (method, path) not in SIMPLE and (route is None or "create_pr=1" in query):
            raise NotServed
        if not authorized:
            raise HubError(401, BAD_TOKEN)
        if path == "/api/whoami-v2":
            token = {"displayName": "test", "role": self.role}
            # a fine-grained token's rights: [{"entity": {"type", "name"}, "permissions"}]
            if self.scoped is not None:
                token["fineGrained"] = {"scoped": self.scoped, "global": []}
            return {
                "name": self.user,
                "type": "user",
                "orgs": [{"name": o, "roleInOrg": "write"} for o in self.orgs],
                "auth": {"type": "access_token", "accessToken": token},
            }
        if path == "/api/repos/create":
            return self.create_repo(_json(body))
        # create_commit asks it about any README.md: every model card is fine here
        if path == "/api/validate-yaml":
            return {"errors": [], "warnings": []}
        repo_id, action, revision = route.group(1), route.group(2), unquote(route.group(3))
        self._writable(repo_id.split("/")[0])
        if not self._repo(repo_id).is_dir():
            raise HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        if action == "branch":
            return self.create_branch(repo_id, revision, _json(body).get("startingPoint") or "main")
        if not self.repo_folder(repo_id, revision).is_dir():
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        if action == "commit":
            return self.commit(repo_id, revision, body)
        files = _json(body).get("files")
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) for f in files
        ):
            raise HubError(400, "preupload wants {'files': [{'path': ...}, ...]}")
        # the client reads "shouldIgnore" unconditionally; no "oid", else it skips files it thinks unchanged and then
        # asks repo_info, which is not served
        return {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}

    def tree(self, repo_id: str, revision: str) -> list[dict]:
        folder = self.repo_folder(repo_id, revision)
        if not folder.is_dir():
            raise HubError(404, f"Repository not found: {repo_id}@{revision}", "RepoNotFound")
        return [
            {"type": "directory", "path": p.relative_to(folder).as_posix(), "oid": "0" * 40, "size": 0}
            if p.is_dir()
            else {
                "type": "file",
                "path": p.relative_to(folder).as_posix(),
                "size": p.stat().st_size,
                "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
            }
            for p in sorted(folder.rglob("*"))
        ]

    def _writable(self, namespace: str) -> None:
        if self.role == "read" or namespace not in (self.user, *self.orgs):
            raise HubError(403, f"You don't have the rights to write to the namespace {namespace!r}")

    def create_repo(self, payload: dict) -> dict:
        if payload.get("type", "model") != "model":
            raise HubError(400, "this fake hub holds model repositories only")
        name, namespace = payload.get("name"), payload.get("organization") or self.user
        if not isinstance(name, str) or not re.fullmatch(NAME, name) or not re.fullmatch(NAME, str(namespace)):
            raise HubError(400, f"invalid repository name {namespace}/{name}")
        self._writable(namespace)
        repo_id = f"{namespace}/{name}"
        # the client takes repo_id from it: it must start with its HF_ENDPOINT
        url = f"{self.url}/{repo_id}"
        with self._lock:
            if self._repo(repo_id).is_dir():
                # exist_ok still reads "url"
                raise HubError(409, "You already created this model repo", url=url)
            self.repo_folder(repo_id).mkdir(parents=True)
            self.repos[repo_id] = {"private": payload.get("visibility") == "private"}
        return {"url": url, "name": repo_id}

    def create_branch(self, repo_id: str, branch: str, start: str) -> dict:
        with self._lock:
            target, source = self.repo_folder(repo_id, branch), self.repo_folder(repo_id, start)
            if target.exists():
                raise HubError(409, "Reference already exists")
            if not source.is_dir():
                raise HubError(404, f"Invalid rev id: {start}", "RevisionNotFound")
            shutil.copytree(source, target)
        return {}

    def commit(self, repo_id: str, revision: str, body: bytes) -> dict:
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError as err:
            raise HubError(400, f"commit payload is not ndjson: {err}") from None
        if not lines or not isinstance(lines[0], dict) or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line")
        # all checked before anything is written: a bad line leaves the branch as it was
        changes = []
        for line in lines[1:]:
            key, value = (line.get("key"), line.get("value")) if isinstance(line, dict) else (None, None)
            if key not in ("file", "deletedFile", "deletedFolder") or not isinstance(value, dict):
                raise HubError(400, f"this fake hub takes regular files and deletions only, not {key!r}")
            parts = PurePosixPath(str(value.get("path", ""))).parts
            if not parts or parts[0] == "/" or ".git" in parts:
                raise HubError(400, f"invalid path in repo {value.get('path')!r}")
            content = None
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"file content must be base64: {value.get('path')!r}")
                try:
                    content = base64.b64decode(value.get("content", ""), validate=True)
                except (TypeError, ValueError) as err:
                    raise HubError(400, f"bad base64 for {value.get('path')!r}: {err}") from None
            changes.append((key, self.repo_folder(repo_id, revision).joinpath(*map(_safe_part, parts)), content))
        with self._lock:
            for key, target, content in changes:
                if key == "file":
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                elif key == "deletedFolder" and target.is_dir():
                    shutil.rmtree(target)
                elif target.is_file():
                    target.unlink()
        oid = hashlib.sha1(f"{repo_id}@{revision}".encode() + body).hexdigest()
        return {
            "success": True,
            "commitOid": oid,
            "commitUrl": f"{self.url}/{repo_id}/commit/{oid}",
            "pullRequestUrl": None,
        }


class _Handler(BaseHTTPRequestHandler):
    server_version = "FakeHub"

    def _serve(self) -> None:
        hub: FakeHub = self.server.hub
        url = urlsplit(self.path)
        hub.requests.append((self.command, url.path))
        status, code = 200, None
        try:
            authorized = self.headers.get("Authorization") == f"Bearer {hub.token}"
            answer = hub.handle(self.command, url.path, url.query, self._body(), authorized)
        except NotServed:
            hub.unhandled.append((self.command, url.path))
            status, answer = 404, {"error": f"fake hub: {self.command} {url.path} is not implemented"}
        except HubError as err:
            status, answer, code = err.status, {"error": str(err), **err.extra}, err.code
        # a bug here: told in the client's error rather than as a dropped connection
        except Exception as err:
            status, answer = 500, {"error": f"fake hub failed: {err!r}"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        # the client quotes it in its errors; a header line must be one line of ASCII
        if status >= 400:
            self.send_header(
                "X-Error-Message", " ".join(answer["error"].encode("ascii", "replace").decode().split())[:500]
            )
        # what hf_raise_for_status maps to RepositoryNotFoundError, RevisionNotFoundError
        if code:
            self.send_header("X-Error-Code", code)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        if self.command in ("GET", "HEAD"):
            return b""
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise HubError(411, "a request body needs a Content-Length")
        if int(length) > MAX_BODY:
            raise HubError(413, f"request body over {MAX_BODY} bytes")
        return self.rfile.read(int(length))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _serve

    # the test's output is for the test
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve(
    root: Path,
    token: str = "hf_fake_write_token",
    user: str = "tester",
    orgs=("test-org",),
    role: str = "write",
    scoped: list | None = None,
):
    hub = FakeHub(root, token, user, orgs, role, scoped)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads, server.hub = True, hub
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    # shutdown() waits out a poll interval: the default half second, paid by every test that closes a fake hub
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, help="gets the URL once the server listens")
    parser.add_argument("--token", default="hf_fake_write_token")
    parser.add_argument("--user", default="tester")
    parser.add_argument("--org", action="append", dest="orgs", help="repeatable (default: test-org)")
    parser.add_argument("--role", default="write")
    args = parser.parse_args()
    with serve(args.root, args.token, args.user, args.orgs or ("test-org",), args.role) as running:
        print(running.url, flush=True)
        # written then renamed: a test polling for the file never reads half a URL
        if args.port_file:
            partial = args.port_file.with_name(args.port_file.name + ".partial")
            partial.write_text(running.url)
            partial.replace(args.port_file)
        threading.Event().wait()
