"""``--push_to_hub true``: the run's final model folder (and a LoRA run's adapter) uploaded to the hub once, at the
end, in one commit; checked before anything starts.

The Trainer's own push does not fit a sharded run: it uploads output_dir itself at every save (run records, the
exported model/ as a subfolder, after writing the tokenizer and a pickled training_args.bin there), and with
hub_strategy checkpoint it would upload sharded checkpoints, which are no model. So the Trainer never sees
push_to_hub (parse sets it false after this check) and fsdp_recipes.train.upload pushes what `from_pretrained` loads.

What can fail before the training is asked here, in one line each: the options that only mean something with
per-save pushes, the repository id, HF_HUB_OFFLINE, a missing or read-only token, an unreachable hub, a namespace
the token cannot write to. The hub is asked by each node's local rank 0 (whoami, which the hub rate-limits)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_recipes.config.model_source import not_a_hub_id, one_line

# TrainingArguments' hub options other than push_to_hub, with their defaults: set without push_to_hub, they would
# be ignored without a word
HUB_OPTIONS = {"hub_model_id": None, "hub_token": None, "hub_private_repo": None, "hub_revision": None,
               "hub_strategy": "every_save", "hub_always_push": False}


def later(push: "HubPush", output_dir: str) -> str:
    """The way round any hub problem: train without the push, upload after."""
    return f"or drop --push_to_hub and upload the model after the run (hf upload {push.repo_id} {Path(output_dir).absolute() / 'model'})"


@dataclass(frozen=True)
class HubPush:
    """Where the final model goes. ``token`` is the one given as hub_token, else None: huggingface_hub's own (HF_TOKEN,
    `hf auth login`); never written to a run record."""

    repo_id: str
    private: bool | None = None
    revision: str | None = None
    token: str | None = None

    def describe(self) -> str:
        branch = f" (branch {self.revision})" if self.revision else ""
        return f"{self.repo_id}{branch}"


def _value(raw, name: str):
    value = getattr(raw, name, HUB_OPTIONS.get(name))
    return getattr(value, "value", value)  # HubStrategy is an enum once TrainingArguments has seen it


def push_plan(raw, explicit: set[str]) -> HubPush | None:
    """The push a run asks for (None: none), or RecipeError with one line. ``explicit``: the keys the recipe or a flag
    set (hub_strategy's default, every_save, is no request for pushes at each save)."""
    from fsdp_recipes.errors import RecipeError

    if not _value(raw, "push_to_hub"):
        stray = [name for name, default in HUB_OPTIONS.items() if name in explicit and _value(raw, name) != default]
        if stray:
            raise RecipeError(f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} used only with --push_to_hub true: "
                              f"add --push_to_hub true to upload the final model, or drop {', '.join(stray)}")
        return None
    strategy = _value(raw, "hub_strategy")
    if strategy in ("checkpoint", "all_checkpoints") or (strategy == "every_save" and "hub_strategy" in explicit):
        raise RecipeError(
            f"hub_strategy {strategy} uploads {'checkpoints' if 'checkpoint' in strategy else 'the model at every save'}; "
            "a sharded run's checkpoints are one file per rank, no model, and resume from output_dir: here the final model "
            "is uploaded once, at the end: drop hub_strategy (or give end)")
    if _value(raw, "hub_always_push"):
        raise RecipeError("hub_always_push concerns pushes at every save; here the final model is uploaded once, at the "
                          "end: drop hub_always_push")
    repo_id = _value(raw, "hub_model_id") or Path(_value(raw, "output_dir") or "trainer_output").absolute().name
    if problem := not_a_hub_id(repo_id, neither="hub repository name"):
        fix = "give --hub_model_id your-name/model-name" if not _value(raw, "hub_model_id") else problem[1]
        raise RecipeError(f"push_to_hub: the repository {repo_id!r} (hub_model_id{'' if _value(raw, 'hub_model_id') else ', from output_dir'}) "
                          f"{problem[0]}: {fix}")
    push = HubPush(repo_id, _value(raw, "hub_private_repo"), _value(raw, "hub_revision"), _value(raw, "hub_token"))
    if os.environ.get("LOCAL_RANK", "0") == "0" and (problem := access_problem(push, later(push, _value(raw, "output_dir") or "trainer_output"))):
        raise RecipeError(f"push_to_hub to {repo_id}: {problem}")
    return push


def access_problem(push: HubPush, way_round: str) -> str | None:
    """Why the hub will not take the upload, found before the training: offline, no token, a read token, a token that
    cannot write to the repository's namespace, or no hub at all. One request (whoami)."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return one_line(("HF_HUB_OFFLINE is set, and an upload needs the hub", f"unset it, {way_round}"))
    token = push.token or get_token()
    if not token:
        return one_line(("no hub token: an upload needs one with write access",
                         f"run `hf auth login` (or set HF_TOKEN, or give --hub_token), {way_round}"))
    try:
        me = HfApi(token=token).whoami(cache=True)
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status == 401:
            return one_line(("the hub refuses the token (401: invalid or expired)",
                             f"log in again (hf auth login) or set HF_TOKEN to a valid token, {way_round}"))
        return _unreachable(err, way_round)
    except Exception as err:  # no network, a proxy, DNS, TLS: in its own words
        return _unreachable(err, way_round)
    access = (me.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        return one_line((f"the token ({access.get('displayName', 'unnamed')}) is read-only",
                         f"use a token with write access (hf auth login), {way_round}"))
    namespace = push.repo_id.split("/")[0] if "/" in push.repo_id else None
    writable = {me.get("name")} | {org.get("name") for org in me.get("orgs") or [] if org.get("roleInOrg") != "read"}
    # a fine-grained token's rights are per repository, beyond what whoami says: create_repo at the end is its test
    if namespace and namespace not in writable and access.get("role") != "fineGrained":
        return one_line((f"the token is {me.get('name')}'s, who cannot write to {namespace!r} (writable: {', '.join(sorted(filter(None, writable)))})",
                         f"give --hub_model_id {me.get('name')}/{push.repo_id.split('/', 1)[1]}, {way_round}"))
    return None


def _unreachable(err: Exception, way_round: str) -> str:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
    return one_line((f"the hub cannot be reached ({type(err).__name__}: {reason})",
                     f"check the network (or HF_ENDPOINT), {way_round}"))
