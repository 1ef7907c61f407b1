"""``--push_to_hub true`` carried out: after the export, rank 0 uploads the final model folder (its files at the
repository's top, what `from_pretrained("<repo id>")` loads) and a LoRA run's adapter (under ``adapter/``, what
`PeftModel.from_pretrained(base, "<repo id>", subfolder="adapter")` loads) in one commit. The other ranks have
finished by then: no collective, so no ddp_timeout, bounds the upload; each of its requests has a deadline
(fsdp_recipes.compat.hub_deadline), its files' bytes too (over LFS, not hf_xet: ``through_http``), so a hub that stops
answering ends it with the model saved and the command that uploads it. The checks that can fail sooner ran at parse
time (fsdp_recipes.config.hub_push)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.layout import ADAPTER_CONFIG, ADAPTER_DIR, BASE_IDENTITY, FINAL_MODEL_DIR
from fsdp_recipes.compat import hub_deadline
from fsdp_recipes.config.hub_push import HubPush
from fsdp_recipes.config.model_source import is_local, missing_local_path, not_a_hub_id
from fsdp_recipes.errors import RecipeError, UnreadableFile


def folders_to_upload(output_dir: Path) -> list[tuple[Path, str]]:
    """(folder, its place in the repository): the model at the top, the adapter beside it when the run has one."""
    out = [(output_dir / FINAL_MODEL_DIR, "")]
    if (output_dir / ADAPTER_DIR / "adapter_config.json").is_file():
        out.append((output_dir / ADAPTER_DIR, ADAPTER_DIR))
    return out


# The names from_pretrained (and peft's PeftModel.from_pretrained, under adapter/) look for, in the order they take
# the first found. A repository file earlier in that order than any of our upload's, which we do not overwrite, is
# what loads instead of this run's model (a single model.safetensors left beside our index of shards).
LOAD_ORDER = {
    "": ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ADAPTER_DIR: ("adapter_model.safetensors", "adapter_model.bin"),
}
# An adapter's files: at the top, transformers' from_pretrained applies that adapter over the model it loads (TRL
# pushes a LoRA run's adapter there); under adapter/, they would be another run's adapter beside this run's model
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# Ours, not the hub's: the local path and hashes of a LoRA run's base (ckpt.base_identity), of use to merges here only
NOT_UPLOADED = (BASE_IDENTITY,)


def stale_files(existing: set[str], ours: set[str]) -> list[str]:
    """The repository's files that would be loaded instead of ours, or with them: left there by an earlier upload.
    Deleting them is the user's to decide: nothing here deletes what it did not make."""
    out = []
    for place, names in LOAD_ORDER.items():
        paths = [f"{place}/{name}".lstrip("/") for name in names]
        first_ours = next((i for i, path in enumerate(paths) if path in ours), None)
        out += [path for path in paths[:first_ours] if path in existing] if first_ours is not None else []
    adapters = [name for name in existing - ours if name in ADAPTER_FILES or name.startswith(f"{ADAPTER_DIR}/")]
    return sorted(set(out) | set(adapters))


def as_uploaded(path: Path, log) -> str | bytes:
    """What goes to the hub for a file of the adapter folder: the file, or for an adapter_config.json that names its
    base by a local path (peft records the folder the run loaded), a copy naming none: that path means nothing off
    this machine and shows the user's folders. A hub id stays: it loads the base anywhere."""
    if path.name != ADAPTER_CONFIG:
        return str(path)
    try:
        config = load_json(path, ADAPTER_CONFIG, JSON_LIMIT)
    except UnreadableFile:
        return str(path)
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or (
        not is_local(base) and not missing_local_path(base) and not_a_hub_id(base) is None
    ):
        return str(path)
    log(
        f"{ADAPTER_DIR}/{ADAPTER_CONFIG} names its base by a local path: uploaded with base_model_name_or_path null "
        f'(PeftModel.from_pretrained(base, "<repo id>", subfolder="{ADAPTER_DIR}") takes the base it is given)'
    )
    return (json.dumps({**config, "base_model_name_or_path": None}, indent=2, sort_keys=True) + "\n").encode()


def upload_final_model(push: HubPush, output_dir: str, step: int | None, log) -> str:
    """Upload and return the commit's URL, or RecipeError naming the folders on disk and the `hf upload` commands
    that finish the job by hand (the model is saved either way)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    out = Path(output_dir)
    folders = folders_to_upload(out)
    by_hand = replace(push, adapter=len(folders) > 1).by_hand(out)
    operations = [
        CommitOperationAdd(
            path_in_repo=f"{place}/{path.relative_to(folder)}".lstrip("/"),
            path_or_fileobj=as_uploaded(path, log) if place == ADAPTER_DIR else str(path),
        )
        for folder, place in folders
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in NOT_UPLOADED
    ]
    log(f"uploading {len(operations)} file(s) of {', '.join(str(f) for f, _ in folders)} to the hub: {push.describe()}")
    # a hub that never answers fails the upload, not the launcher's wait
    hub_deadline.install()
    api = HfApi(token=push.token)
    try:
        repo = api.create_repo(push.repo_id, private=push.private, exist_ok=True)
        if push.revision:
            api.create_branch(repo.repo_id, branch=push.revision, exist_ok=True)
        ours = {op.path_in_repo for op in operations}
        if stale := stale_files(set(api.list_repo_files(repo.repo_id, revision=push.revision)), ours):
            raise RecipeError(
                f"the model is saved, but not uploaded: {push.describe()} already holds {', '.join(stale[:6])}"
                f"{', ...' if len(stale) > 6 else ''}, of an earlier model, which from_pretrained would load "
                "instead of this "
                f"one or with it: "
                f"delete {'it' if len(stale) == 1 else 'them'} on the hub (or give another --hub_model_id or "
                f"--hub_revision), then `{by_hand}`"
            )
        # every byte under the deadline: hf_xet's shard upload has none
        with hub_deadline.through_http():
            commit = api.create_commit(
                repo.repo_id,
                operations,
                revision=push.revision,
                commit_message=f"train_fsdp.py: final model{f' at step {step}' if step is not None else ''}",
            )
    except RecipeError:
        raise
    # the network, no answer, the hub's refusal, a quota: the model stays saved
    except Exception as err:
        raise RecipeError(
            f"the model is saved, but its upload to {push.describe()} failed ({hub_deadline.said(err, 200)}): "
            f"upload it with `{by_hand}`"
        ) from None
    return commit.commit_url
