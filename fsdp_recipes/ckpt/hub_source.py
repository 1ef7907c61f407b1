"""A model named by a local path or a hub id, before anything reads it: names that can only be local paths, names the
hub refuses as ids, and whether the hub has one (asked once, within fsdp_recipes.compat.hub_deadline's deadline:
transformers and datasets retry each file for minutes against a hub that never answers). The config checks
(fsdp_recipes.config.model_source) and the merge's --base-model (``base_model_problem``) ask the same questions.
"""

from __future__ import annotations

import functools
import os

from fsdp_recipes.compat import hub_deadline


def one_line(problem: tuple[str, str]) -> str:
    """A (why, fix) problem as the one line of a RecipeError or a tool's error."""
    return f"{problem[0]}: {problem[1]}"


def is_local(name: str) -> bool:
    """Whether ``name`` (``~`` expanded) is a path on this machine; a name no filesystem can look up (over its length
    limit, a NUL byte) is not one: os.path.exists says False where open() would raise."""
    return os.path.exists(os.path.expanduser(name))


def missing_local_path(name: str) -> bool:
    """True when ``name`` can only mean a local path (absolute, ./ ../ ~, a trailing slash, more than one slash, or
    under a folder that exists) and nothing is there: no hub id, so the hub is never asked about it."""
    if is_local(name):
        return False
    parts = name.split("/")
    return (
        name.startswith(("/", "./", "../", "~"))
        or name.endswith("/")
        or len(parts) > 2
        or (len(parts) == 2 and os.path.isdir(parts[0]))
    )


def not_a_hub_id(name: str, local: str = "folder", neither: str = "local path") -> tuple[str, str] | None:
    """(why, fix) when ``name``, which is no local path, is no hub id either; huggingface_hub raises its validation
    error from every lookup of it, whose first sentence is quoted, cut at a word if long."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError as err:
        said = str(err).splitlines()[0].split(". ")[0].rstrip(".")
        if len(said) > 120:
            said = said[:120].rsplit(" ", 1)[0] + " ..."
        return (f"is neither a {neither} nor a hub id ({said})", f"give a local {local} or a hub id (org/name)")
    return None


# the model and its tokenizer are often one id: one request
@functools.lru_cache(maxsize=16)
def hub_problem(
    repo_id: str, filename: str | None, repo_type: str = "model", revision: str | None = None
) -> str | None:
    """Why a hub id not in the local cache cannot be downloaded, asked of the hub once before anything starts (one
    request, within its deadline: fsdp_recipes.compat.hub_deadline; transformers and datasets retry for a minute or
    more on every rank, then end in a traceback each).
    ``filename``: a file the repository must have (None: only that it exists); ``revision``: at that revision (a
    model's model_revision; None: main)."""
    from huggingface_hub import file_exists, repo_exists, revision_exists
    from huggingface_hub.errors import GatedRepoError

    hub_deadline.install()
    where = "dataset" if repo_type == "dataset" else "model"
    if problem := not_a_hub_id(repo_id, where):
        return one_line(problem)
    try:
        if filename is not None:
            found = file_exists(repo_id, filename, repo_type=repo_type, revision=revision)
        # repo_exists has no revision
        else:
            ask = functools.partial(revision_exists, revision=revision) if revision else repo_exists
            found = ask(repo_id, repo_type=repo_type)
        if found:
            return None
    except GatedRepoError:
        return (
            f"is a gated {where} on the hub: accept its terms on its hub page and log in (hf auth login), or give a "
            "local folder"
        )
    # no network, a proxy, DNS, TLS, no answer: whatever stops the request, in its words
    except Exception as err:
        return (
            f"is not in the local hub cache and the hub cannot be reached ({hub_deadline.said(err)}): give a "
            f"local folder, or download it where the hub is reachable (hf download {repo_id}"
            f"{' --repo-type dataset' if repo_type == 'dataset' else ''}) and set HF_HUB_OFFLINE=1"
        )
    return (
        f"is not a {where} on the hub{f' with a {filename}' if filename else ''}"
        f"{f' at revision {revision!r}' if revision is not None else ''} (a typo in the id or revision, a private "
        "repository without a login, "
        "or a path that does not exist where you launch): give a local folder or the exact hub id"
    )


def base_model_problem(name: str) -> str | None:
    """Why --base-model ``name`` cannot give a merge its config, in one line, found before anything is read: a name that
    can only be a local path and is not there (never quoted the hub's rule for repository ids), or a hub id neither in
    the hub cache nor answered for within the deadline. None: a local path that exists, or a hub id to load."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not name.strip():
        return "--base-model is empty: give the base model's folder or a hub id"
    if is_local(name):
        # a local folder or file: the merge's own checks say what it lacks
        return None
    if missing_local_path(name):
        return (
            f"--base-model {name} does not exist (relative paths start where you launch): give the base model's "
            "folder or a hub id"
        )
    if problem := not_a_hub_id(name, "folder, its config.json"):
        return f"--base-model {name} {one_line(problem)}"
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return (
            f"--base-model {name} is neither a local folder nor in the hub cache: give a local folder, or unset "
            "HF_HUB_OFFLINE to download it"
        )
    problem = hub_problem(name, "config.json")
    return f"--base-model {name} {problem}" if problem else None
