"""Every request huggingface_hub sends in this process (ours, and transformers' and datasets' through it) has a
deadline: a hub that accepts the connection and never answers ends the call with a timeout, not a wait forever.

huggingface_hub 2.x gives its shared HTTP client no timeout, and most of its API calls (whoami, repo_info,
create_repo, create_commit, ...) pass none; only downloads and file metadata have theirs (HF_HUB_DOWNLOAD_TIMEOUT,
HF_HUB_ETAG_TIMEOUT). Its constants say HF_HUB_DOWNLOAD_TIMEOUT is "also used as a default timeout for other requests
if not specified": that is what this does, through the library's own client factory (set_client_factory) and an
httpx event hook. The deadline bounds each wait (connect, each read and write), not a whole transfer, so a large
upload that keeps moving is never cut; a request that gave its own timeout keeps it. HF_HUB_DOWNLOAD_TIMEOUT
(seconds, 10 by default) raises it for a slow hub.

An upload's large files would otherwise go through hf_xet (where it is installed, as huggingface_hub installs it),
whose Rust client this hook does not reach. Its own timeouts (HF_XET_CLIENT_CONNECT_TIMEOUT, 60 s;
HF_XET_CLIENT_READ_TIMEOUT, 300 s without a byte) leave one wait unbounded: hf_xet 1.8 sends the upload's shard
(the commit of its chunks) through a client built with no read timeout at all, so a hub that takes it and never
answers holds the upload forever, and no setting changes that. ``through_http`` sends an upload's files the way
huggingface_hub does without hf_xet: Git LFS, over its HTTP client, each wait under the deadline. The hub takes LFS
uploads into Xet-backed repositories and converts them itself ("Backward Compatibility with LFS" in its docs).
"""

from __future__ import annotations

from contextlib import contextmanager

from fsdp_recipes.compat import internals

# httpx's timeouts, each a wait of its own
WAITS = ("connect", "read", "write", "pool")
_installed: list[bool] = []


def seconds() -> float:
    """The deadline now: huggingface_hub's HF_HUB_DOWNLOAD_TIMEOUT, read at each request."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _deadline(request) -> None:
    """An httpx request hook: each wait the request left unbounded gets the deadline."""
    waits = request.extensions.get("timeout") or {}
    if any(waits.get(name) is None for name in WAITS):
        limit = seconds()
        filled = {name: limit if waits.get(name) is None else waits[name] for name in WAITS}
        request.extensions = {**request.extensions, "timeout": filled}


def _client():
    client = internals.get("huggingface_hub.utils._http.default_client_factory")()
    hooks = client.event_hooks
    client.event_hooks = {**hooks, "request": [*hooks.get("request", []), _deadline]}
    return client


def install() -> None:
    """Give huggingface_hub's client the deadline, once per process (a new client after a fork keeps it: the factory
    makes every one)."""
    if not _installed:
        from huggingface_hub import set_client_factory

        set_client_factory(_client)
        _installed.append(True)


@contextmanager
def through_http():
    """Within it, huggingface_hub uploads files over LFS and its HTTP client, as with HF_HUB_DISABLE_XET=1: the
    constant that variable sets at import is read at each upload (utils._runtime.is_xet_available), so a process that
    imported huggingface_hub long ago (rank 0, after training) turns it on here, for this upload only."""
    before = internals.patch("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)
    try:
        yield
    finally:
        internals.patch("huggingface_hub.constants.HF_HUB_DISABLE_XET", before)


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` is a request that hit its deadline (httpx's timeouts, or an error huggingface_hub raised from
    one)."""
    # the exception and what it was raised from
    for _ in range(8):
        if err is None:
            return False
        if "Timeout" in type(err).__name__:
            return True
        err = err.__cause__ or err.__context__
    return False


def said(err: BaseException, limit: int = 160) -> str:
    """A failed hub request in its own words, for a one-line message; a timeout names the settings of its deadline."""
    if timed_out(err):
        return (
            f"{type(err).__name__}: no answer within the deadline, seconds set by HF_HUB_DOWNLOAD_TIMEOUT (requests) "
            "and HF_HUB_ETAG_TIMEOUT (file lookups)"
        )
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or ['no details'])[0][:limit]}"
