"""Shard digests: which .distcp files a training run wrote into a checkpoint (SHARD_DIGESTS: each file's size and a
SHA-256 of its first and last MiB, written once every rank has finished), and which files of a checkpoint are no
longer those (swapped with another rank's, copied from another checkpoint, replaced or damaged). Not a defence
against forgery.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# ----------------------------------------------------------------------------------------------- shard digests

# bytes hashed at each end of a .distcp file: cheap at any size, different on every rank
_DIGEST_SAMPLE = 1 << 20


def shard_digest(path: Path) -> dict:
    """Size and a SHA-256 of the first and last MiB: tells two ranks' files apart (a swap, a copy from another
    checkpoint, a file replaced since) without reading a 100 GB shard. Not a defence against forgery."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_DIGEST_SAMPLE))
        if size > _DIGEST_SAMPLE:
            f.seek(max(size - _DIGEST_SAMPLE, _DIGEST_SAMPLE))
            digest.update(f.read(_DIGEST_SAMPLE))
    return {"size": size, "sha256": digest.hexdigest()}


def _digest_form(entry) -> bool:
    """An entry as shard_digest writes it: a whole size and a SHA-256 in hex."""
    return (
        isinstance(entry, dict)
        and type(entry.get("size")) is int
        and entry["size"] >= 0
        and isinstance(entry.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) is not None
    )


def write_shard_digests(ckpt: Path, folders: tuple[str, ...]) -> None:
    """SHARD_DIGESTS in a checkpoint whose every rank has finished writing (rank 0, after the last barrier)."""
    from fsdp_recipes.ckpt.layout import SHARD_DIGESTS, step_of_name

    # .metadata too: it says where each chunk lies, which the shards alone do not
    files = {
        f"{folder}/{p.name}": shard_digest(p)
        for folder in folders
        if (ckpt / folder).is_dir()
        for p in sorted((ckpt / folder).iterdir())
        if p.suffix == ".distcp" or p.name == ".metadata"
    }
    # the record belongs to this step: another checkpoint's, copied in with its shards, is named
    step = step_of_name(ckpt)
    record = {
        "format": 1,
        "sample_bytes": _DIGEST_SAMPLE,
        **({"step": step} if step is not None else {}),
        "files": files,
    }
    (ckpt / SHARD_DIGESTS).write_text(json.dumps(record, indent=1) + "\n")


def _step_of(ckpt: Path) -> int | None:
    """The step a checkpoint is of: its name's (checkpoint-N), else its trainer_state.json's global_step."""
    from fsdp_recipes.ckpt.layout import step_of_name

    step = step_of_name(ckpt)
    return step if step is not None else _state_step(ckpt)


def _state_step(ckpt: Path) -> int | None:
    from fsdp_recipes.bounded import STATE_LIMIT, load_json

    try:
        step = load_json(ckpt / "trainer_state.json", "trainer_state.json", STATE_LIMIT).get("global_step")
    except (ValueError, OSError, AttributeError):
        return None
    return step if type(step) is int else None


def digest_problems(ckpt: Path, folders: tuple[str, ...]) -> list[str]:
    """Shard files of ``folders`` that are not the ones the training run wrote (checked when the checkpoint has
    SHARD_DIGESTS: checkpoints of other tools have none)."""
    from fsdp_recipes.bounded import JSON_LIMIT, load_json
    from fsdp_recipes.ckpt.layout import MANIFEST, SHARD_DIGESTS

    path = Path(ckpt) / SHARD_DIGESTS
    # our runs announce the digests in the manifest, which is written before any shard, and sealed with their step
    try:
        manifest = (
            load_json(Path(ckpt) / MANIFEST, MANIFEST, JSON_LIMIT) if os.path.lexists(Path(ckpt) / MANIFEST) else {}
        )
    except ValueError:
        # an unreadable manifest is named by description.recorded_changes
        manifest = {}
    if not os.path.lexists(path):
        return (
            [
                f"missing {SHARD_DIGESTS} (written last, once every rank had finished: the save did not finish, or it "
                "was removed)"
            ]
            if manifest.get("shard_digests")
            else []
        )
    try:
        record = load_json(path, SHARD_DIGESTS, JSON_LIMIT)
        files = record["files"] if record.get("sample_bytes") == _DIGEST_SAMPLE else None
        if not isinstance(files, dict) or not all(_digest_form(v) for v in files.values()):
            # an entry that is no size and hash is no record of a file: not a swap
            raise ValueError
    except (ValueError, TypeError, KeyError, OSError):
        return [f"unreadable {SHARD_DIGESTS}: copy the checkpoint again"]
    # The step the record names must be the folder's (its name's, else trainer_state.json's) and the one the manifest
    # was sealed with; a sealed manifest also means the record names one (an older version's record names none).
    recorded, sealed = record.get("step"), manifest.get("shard_digests_step")
    for what, value in ((SHARD_DIGESTS, recorded), (f"{MANIFEST}'s shard_digests_step", sealed)):
        # True == 1, 6.0 == 6: no step number
        if value is not None and not (type(value) is int and value >= 0):
            return [
                f"{what} is {json.dumps(value)[:40]}, not a step number: the record was edited; copy the "
                "checkpoint again"
            ]
    steps = [s for s in (_step_of(Path(ckpt)), sealed) if s is not None]
    if (recorded is not None or sealed is not None) and (wrong := [s for s in steps if s != recorded]):
        # every record agrees but the folder's name
        if recorded == sealed == _state_step(Path(ckpt)) != wrong[0]:
            return [
                f"{Path(ckpt).name} was renamed: its trainer_state.json, {SHARD_DIGESTS} and {MANIFEST} are of "
                f"step {recorded}; "
                f"give it back its name checkpoint-{recorded}"
            ]
        whose = "of no step (an older version's)" if recorded is None else f"that of step {json.dumps(recorded)[:40]}"
        return [
            f"{SHARD_DIGESTS} is {whose}, and this checkpoint is of step {wrong[0]}: its shard folders "
            "were copied from another checkpoint (with their digests): copy this checkpoint again from where "
            "it was written"
        ]
    problems = []
    for name, expected in sorted(files.items()):
        if not isinstance(name, str) or name.split("/")[0] not in folders:
            continue
        shard = Path(ckpt) / name
        if shard.is_file() and shard_digest(shard) != expected:
            problems.append(
                f"{name} is not the file this checkpoint wrote ({SHARD_DIGESTS} has another size or hash: "
                "swapped with another rank's, replaced or damaged): copy the checkpoint again"
            )
    return problems
