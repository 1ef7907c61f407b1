"""Which base model a LoRA adapter was trained on, recorded and checked.

An adapter-only checkpoint (and the exported adapter folder) holds no frozen weight: a resume and a merge take them
from the base model, named by path or hub id. A name says nothing of the bytes behind it: a base folder replaced,
re-saved from another seed, zeroed or truncated since still has the name, and the run would resume (or the merge
write) a model nobody trained, silently. So the run records the base's identity once, before training, and writes
it into every checkpoint and the adapter folder (``base_identity.json``); a resume and a merge compare the base
they are given against it and refuse another one, naming what differs.

The identity is the SHA-256 of every stored tensor's bytes with its name, dtype and shape (how the base is split
into files, and the files' headers, do not count: a base re-sharded with the same weights is the same base), and
of its config.json without the keys that do not describe the weights. Hashing reads the base once (about 1.5 GB/s
per thread: a 16 GB base takes seconds on a node's cores, the time of loading it), on one rank.

Standard library (+ tqdm, huggingface_hub's cache lookup) only: tools/check_checkpoint.py imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.layout import BASE_IDENTITY
from fsdp_recipes.errors import CheckpointError

FORMAT = 1
# config.json keys that say nothing of the weights: transformers rewrites them on every save (and the Trainer turns
# use_cache off for training)
CONFIG_BOOKKEEPING = frozenset(
    {"_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "use_cache"}
)
_CHUNK = 64 << 20
# a bar for bases of 1 GB and more
_PROGRESS_FROM = 1 << 30


def local_folder(name: str, revision: str | None = None) -> Path | None:
    """The local folder of base ``name``: itself when it is one, else the hub cache's snapshot of that repo id at
    ``revision`` (None: main) when its weights are there (never downloads); None when neither."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                name, revision=revision, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]
            )
        )
    # not a hub id (HFValidationError), or not in the cache (LocalEntryNotFoundError)
    except (OSError, ValueError):
        return None


def config_digest(folder: Path) -> str:
    try:
        config = load_json(folder / "config.json", "config.json", JSON_LIMIT)
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{folder / 'config.json'} cannot be read ({err}): the base model folder is damaged"
        ) from None
    kept = {k: v for k, v in config.items() if k not in CONFIG_BOOKKEEPING}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _tensor_digest(path: Path, offset: int, nbytes: int, name: str, dtype: str, shape: tuple, bar) -> str:
    h = hashlib.sha256(f"{name}\0{dtype}\0{list(shape)}\0".encode())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            chunk = os.pread(fd, min(_CHUNK, nbytes - done), offset + done)
            if not chunk:
                raise CheckpointError(f"{path} ends inside {name}: the base model's weights are truncated")
            # hashlib lets other threads run while it hashes a large buffer
            h.update(chunk)
            done += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        os.close(fd)
    return h.hexdigest()


def identity(folder: str | os.PathLike, name: str | None = None) -> dict:
    """The identity of the base model in ``folder`` (safetensors weights + config.json); ``name``: how the run
    named it (a hub id), kept for the messages."""
    from tqdm.auto import tqdm

    from fsdp_recipes.ckpt.readers import SafetensorsSource

    folder = Path(folder)
    # checks the headers and that no file is shorter than they say
    source = SafetensorsSource(folder)
    plan = {n: (source.path / file, offset, nbytes) for n, (file, _, offset, nbytes) in source._where.items()}
    total = sum(nbytes for _, _, nbytes in plan.values())
    threads = max(1, min(8, os.cpu_count() or 1, len(plan)))
    with (
        tqdm(
            total=total, unit="B", unit_scale=True, desc="Hashing the base model", disable=total < _PROGRESS_FROM
        ) as bar,
        ThreadPoolExecutor(threads) as pool,
    ):
        futures = {
            n: pool.submit(
                _tensor_digest, path, offset, nbytes, n, source.tensors[n].dtype, source.tensors[n].shape, bar
            )
            for n, (path, offset, nbytes) in plan.items()
        }
        tensors = {n: f.result() for n, f in sorted(futures.items())}
    return {
        "format": FORMAT,
        "base_model": name or str(folder),
        "config_sha256": config_digest(folder),
        "bytes": total,
        "tensors": tensors,
    }


def write(folder: str | os.PathLike, record: dict) -> None:
    (Path(folder) / BASE_IDENTITY).write_text(json.dumps(record, indent=1) + "\n")


def read(folder: str | os.PathLike) -> dict | None:
    """The record in ``folder`` (None when there is none: a checkpoint of another tool or of an older run)."""
    path = Path(folder) / BASE_IDENTITY
    if not os.path.lexists(path):
        return None
    try:
        record = load_json(path, BASE_IDENTITY, JSON_LIMIT)
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path} is not a base identity record ({err}): restore it from the run, or remove it to "
            "skip the check of the base model"
        ) from None
    tensors = record.get("tensors")
    if (
        record.get("format") != FORMAT
        or not isinstance(record.get("config_sha256"), str)
        or not isinstance(tensors, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in tensors.items())
    ):
        raise CheckpointError(
            f"{path} is not a base identity record this version writes (format {FORMAT}: config_sha256, "
            "tensors): restore it from the run, or remove it to skip the check of the base model"
        )
    return record


def difference(recorded: dict, current: dict) -> str | None:
    """What differs between the base a record names and the base at hand, in a few words; None: the same base."""
    want, have = recorded["tensors"], current["tensors"]
    parts = []
    if missing := sorted(set(want) - set(have)):
        parts.append(f"{len(missing)} weight(s) missing (e.g. {missing[0]})")
    if extra := sorted(set(have) - set(want)):
        parts.append(f"{len(extra)} weight(s) it did not have (e.g. {extra[0]})")
    if changed := sorted(n for n in set(want) & set(have) if want[n] != have[n]):
        parts.append(f"{len(changed)} of {len(want)} weight(s) hold other values, dtype or shape (e.g. {changed[0]})")
    if recorded["config_sha256"] != current["config_sha256"]:
        parts.append("config.json describes another model")
    return "; ".join(parts) or None


def base_problem(recorded: dict, folder: str | os.PathLike, what: str, fix: str) -> str | None:
    """Why the base in ``folder`` is not the one ``recorded`` names (one line), or None. ``what``: whose record it
    is (a checkpoint, an adapter folder); ``fix``: what to do instead."""
    try:
        current = identity(folder)
    except CheckpointError as err:
        return f"the base model {folder} cannot be read as the one {what} was trained on ({err}); {fix}"
    if (diff := difference(recorded, current)) is None:
        return None
    return (
        f"the base model {folder} is not the one {what} was trained on ({recorded.get('base_model')!s}, recorded in "
        f"{BASE_IDENTITY}): {diff}; {fix}"
    )
