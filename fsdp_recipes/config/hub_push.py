"""``--push_to_hub true``: the run's final model folder (and a LoRA run's adapter) uploaded to the hub once, at the
end, in one commit; checked before anything starts.

The Trainer's own push does not fit a sharded run: it uploads output_dir itself at every save (run records, the
exported model/ as a subfolder, after writing the tokenizer and a pickled training_args.bin there), and with
hub_strategy checkpoint it would upload sharded checkpoints, which are no model. So the Trainer never sees
push_to_hub (parse sets it false after this check) and fsdp_recipes.train.upload pushes what `from_pretrained` loads.

What can fail before the training is asked here, in one line each: hub_strategy checkpoint (uploads to resume
from), the repository id and branch name, HF_HUB_OFFLINE, a missing or read-only token, an unreachable hub,
a namespace the token cannot write to, hub_private_repo true for a repository that exists and is public. The hub is
asked by each node's local rank 0 (whoami, which the hub rate-limits, and the repository's visibility), each request
within its deadline (fsdp_recipes.compat.hub_deadline): a hub that never answers stops the run here, in one line."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.ckpt.layout import ADAPTER_DIR, FINAL_MODEL_DIR
from fsdp_recipes.compat import hub_deadline
from fsdp_recipes.config.model_source import not_a_hub_id, one_line
from fsdp_recipes.console import say

# TrainingArguments' hub options other than push_to_hub, with their defaults: set without push_to_hub, they would
# be ignored without a word
HUB_OPTIONS = {
    "hub_model_id": None,
    "hub_token": None,
    "hub_private_repo": None,
    "hub_revision": None,
    "hub_strategy": "every_save",
    "hub_always_push": False,
}


@dataclass(frozen=True)
class HubPush:
    """Where the final model goes. ``token`` is the one given as hub_token, else None: huggingface_hub's own (HF_TOKEN,
    `hf auth login`); never written to a run record, nor shown. ``adapter``: a LoRA run, whose adapter goes too."""

    repo_id: str
    private: bool | None = None
    revision: str | None = None
    token: str | None = field(default=None, repr=False)
    adapter: bool = False

    def describe(self) -> str:
        branch = f" (branch {self.revision})" if self.revision else ""
        return f"{self.repo_id}{branch}"

    def by_hand(self, output_dir: str | Path) -> str:
        """The `hf upload` commands that do what the push would have, with its branch and privacy."""
        out = Path(output_dir).absolute()
        options = (f" --revision {self.revision}" if self.revision else "") + (" --private" if self.private else "")
        folders = [(out / FINAL_MODEL_DIR, "")] + ([(out / ADAPTER_DIR, f" {ADAPTER_DIR}")] if self.adapter else [])
        return "; ".join(f"hf upload {self.repo_id} {folder}{place}{options}" for folder, place in folders)


def later(push: HubPush, output_dir: str) -> str:
    """The way round any hub problem: train without the push, upload after."""
    return f"or drop --push_to_hub and upload the model after the run ({push.by_hand(output_dir)})"


def _value(raw, name: str):
    value = getattr(raw, name, HUB_OPTIONS.get(name))
    # HubStrategy is an enum once TrainingArguments has seen it
    return getattr(value, "value", value)


def revision_problem(revision: str) -> str | None:
    """Why a branch name cannot be pushed to, by git's rules for ref names (git check-ref-format) and the hub's: its
    pull-request refs take no direct commits. The hub would refuse it at the end, after the training."""
    if revision.startswith("refs/pr/"):
        return "is a pull request's ref: the hub takes commits to it only as a pull request"
    parts = revision.split("/")
    bad = (
        any(not part or part.startswith(".") or part.endswith(".lock") for part in parts)
        or revision.endswith(".")
        or ".." in revision
        or "@{" in revision
        or any(c in revision for c in " ~^:?*[\\")
        or any(ord(c) < 32 or ord(c) == 127 for c in revision)
    )
    return (
        "is not a valid branch name (git's rules: no spaces, '..', any of ~^:?*[\\, a part starting with '.', ...)"
        if bad
        else None
    )


def push_plan(raw, explicit: set[str]) -> HubPush | None:
    """The push a run asks for (None: none), or RecipeError with one line. ``explicit``: the keys the recipe or a flag
    set (hub_strategy's default, every_save, is no request for pushes at each save)."""
    from fsdp_recipes.errors import RecipeError

    # a TRL or handbook recipe keeps its hub keys with push_to_hub false: said, not refused
    if not _value(raw, "push_to_hub"):
        stray = [name for name, default in HUB_OPTIONS.items() if name in explicit and _value(raw, name) != default]
        if stray:
            say(
                f"warning: {', '.join(stray)} {'is' if len(stray) == 1 else 'are'} set, and push_to_hub is "
                "false: nothing is "
                "uploaded (--push_to_hub true uploads the final model)"
            )
        return None
    strategy = _value(raw, "hub_strategy")
    if strategy in ("checkpoint", "all_checkpoints"):
        raise RecipeError(
            f"hub_strategy {strategy} uploads checkpoints to resume from; a sharded run's checkpoints are one "
            "file per rank, "
            "no model, and resume from output_dir: here the final model is uploaded once, at the end: drop "
            "hub_strategy "
            "(or give end)"
        )
    per_save = [
        name
        for name in ("hub_strategy", "hub_always_push")
        if name in explicit and _value(raw, name) not in ("end", False)
    ]
    # the handbook's recipes say hub_strategy: every_save
    if per_save:
        say(
            f"warning: {', '.join(f'{n}={_value(raw, n)}' for n in per_save)} asks for uploads at every save; a "
            "sharded run's "
            "checkpoints are no model, so the final model is uploaded once, at the end"
        )
    named = _value(raw, "hub_model_id")
    if named is not None and not str(named).strip():
        raise RecipeError(
            "hub_model_id is empty: give your-name/model-name, or drop it to name the repository after output_dir"
        )
    output_dir = _value(raw, "output_dir") or "trainer_output"
    repo_id = named or Path(output_dir).absolute().name
    if problem := not_a_hub_id(repo_id, neither="hub repository name"):
        where = "hub_model_id" if named else "hub_model_id, from output_dir's name"
        raise RecipeError(
            f"push_to_hub: the repository {repo_id!r} ({where}) {problem[0]}: give --hub_model_id "
            "your-name/model-name (letters, digits, '-', '_', '.'; at most 96 characters)"
        )
    revision = _value(raw, "hub_revision")
    if revision is not None and (problem := revision_problem(str(revision))):
        raise RecipeError(
            f"push_to_hub: hub_revision {revision!r} {problem}: give a branch name such as run-1, or drop it"
        )
    push = HubPush(
        repo_id,
        _value(raw, "hub_private_repo"),
        revision,
        _value(raw, "hub_token"),
        bool(getattr(raw, "use_peft", False)),
    )
    if os.environ.get("LOCAL_RANK", "0") == "0" and (problem := access_problem(push, later(push, output_dir))):
        raise RecipeError(f"push_to_hub to {repo_id}: {problem}")
    return push


def access_problem(push: HubPush, way_round: str) -> str | None:
    """Why the hub will not take the upload as asked, found before the training: offline, no token, a read token, a
    token that cannot write to the repository's namespace, no hub at all, or a public repository asked to be private.
    Two requests (whoami; the repository's info, when it is to be private)."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    hub_deadline.install()
    if constants.HF_HUB_OFFLINE:
        return one_line(("HF_HUB_OFFLINE is set, and an upload needs the hub", f"unset it, {way_round}"))
    token = push.token or get_token()
    if not token:
        return one_line(
            (
                "no hub token: an upload needs one with write access",
                f"run `hf auth login` (or set HF_TOKEN, or give --hub_token), {way_round}",
            )
        )
    api = HfApi(token=token)
    try:
        me = api.whoami(cache=True)
    except HfHubHTTPError as err:
        if getattr(err.response, "status_code", None) == 401:
            return one_line(
                (
                    "the hub refuses the token (401: invalid or expired)",
                    f"log in again (hf auth login) or set HF_TOKEN to a valid token, {way_round}",
                )
            )
        return _unreachable(err, way_round)
    # no network, a proxy, DNS, TLS: in its own words
    except Exception as err:
        return _unreachable(err, way_round)
    access = (me.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        return one_line(
            (
                f"the token ({access.get('displayName', 'unnamed')}) is read-only",
                f"use a token with write access (hf auth login), {way_round}",
            )
        )
    user = me.get("name")
    namespace, name = push.repo_id.split("/", 1) if "/" in push.repo_id else (user, push.repo_id)
    if not may_write(me, access, namespace, f"{namespace}/{name}"):
        writable = sorted(
            filter(None, {user} | {org.get("name") for org in me.get("orgs") or [] if org.get("roleInOrg") != "read"})
        )
        return one_line(
            (
                f"the token is {user}'s, which cannot write to {namespace!r} (writable: {', '.join(writable)})",
                f"give --hub_model_id {user}/{name}, {way_round}",
            )
        )
    # create_repo(exist_ok=True) leaves an existing repository as it is: public stays public
    if push.private:
        try:
            info = api.repo_info(f"{namespace}/{name}")
        except RepositoryNotFoundError:
            # made private at the end
            return None
        except Exception as err:
            return _unreachable(err, way_round)
        if info.private is False:
            return one_line(
                (
                    f"hub_private_repo is true, and {namespace}/{name} exists and is public: the upload would be "
                    "public",
                    f"make the repository private on the hub first, or give another --hub_model_id, {way_round}",
                )
            )
    return None


def may_write(me: dict, access: dict, namespace: str, repo_id: str) -> bool:
    """Whether whoami's answer lets the token write to ``repo_id``: a write token, for the user's own namespace or an
    org it may write to; a fine-grained token, by its scoped permissions (repo.write on the user, the org or the
    repository). A fine-grained answer in a form not known here is not judged: create_repo at the end is its test."""
    if access.get("role") != "fineGrained":
        orgs = {org.get("name") for org in me.get("orgs") or [] if org.get("roleInOrg") != "read"}
        return namespace == me.get("name") or namespace in orgs
    scoped = (access.get("fineGrained") or {}).get("scoped")
    if not isinstance(scoped, list):
        return True
    for entry in scoped:
        entity = (entry or {}).get("entity") or {}
        if "repo.write" in ((entry or {}).get("permissions") or []) and (
            (entity.get("type") in ("user", "org") and entity.get("name") == namespace)
            or (entity.get("type") == "model" and entity.get("name") == repo_id)
        ):
            return True
    return False


def _unreachable(err: Exception, way_round: str) -> str:
    return one_line(
        (
            f"the hub cannot be reached ({hub_deadline.said(err)})",
            f"check the network (or HF_ENDPOINT), {way_round}",
        )
    )
