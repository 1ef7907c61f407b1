"""Any FSDP checkpoint -> a Hugging Face model folder, streamed in bounded memory (tools/merge_checkpoint.py).

The order is the point: every check that can fail runs before the copy (the input's layout and completeness, a
config to describe it, the output path, free space), so a bad input costs seconds, never the copy of the whole
model. The one slow check, the weights against the model transformers builds from the config (about 4 s of
imports), runs in a thread beside the copy when it has to (the byte copies in a child process, off this one's GIL):
the copy asks it between pieces of 64 MB and stops at once when it failed. Checkpoints our training run wrote carry
a manifest and need no transformers at all.
Output is written into a hidden folder beside the target and renamed when complete; the output may never be
the input, inside it or hold it, and --overwrite never replaces a folder holding training checkpoints.
"""

from __future__ import annotations

import copy
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.description import (
    CheckpointFiles,
    Description,
    config_origin,
    describe_with_transformers,
    described_by_manifest,
    model_skeleton,
    read_files,
    recorded_changes,
)
from fsdp_recipes.ckpt.hub_source import base_model_problem
from fsdp_recipes.ckpt.inspection import verify_folder
from fsdp_recipes.ckpt.layout import (
    MANIFEST,
    is_exported_adapter,
    is_model_folder,
    overlap,
    real,
)
from fsdp_recipes.ckpt.lora_input import lora_input, refuse_merged_tied
from fsdp_recipes.ckpt.lora_merge import (
    AdapterOnBaseSource,
    MergedLoraSource,
)
from fsdp_recipes.ckpt.merge_output import (
    STAGING,
    check_output,
    check_pool,
    remove_stale_staging,
    restore_interrupted,
    staging_name,
)
from fsdp_recipes.ckpt.namespace import guess_weights, match_namespace
from fsdp_recipes.ckpt.readers import dtype_name, unconvertible_dtype
from fsdp_recipes.ckpt.resolve import ResolvedInput, resolve_input
from fsdp_recipes.ckpt.safetensors_writer import Cancelled, weight_files, write_weights
from fsdp_recipes.ckpt.torch_names import DTYPE_SIZES
from fsdp_recipes.compat import hub_deadline, internals
from fsdp_recipes.direct_writes import sync_entries, sync_folder
from fsdp_recipes.errors import CheckpointError, RefusedRemoval
from fsdp_recipes.removal import (
    MARKER,
    contents,
    identity,
    is_ours,
    keep_aside,
    make_folder,
    mount_points,
    move,
    reclaim,
    remark,
    remove,
    remove_file,
    unmark,
)

# torch is imported where tensors are handled, not here: a merge of a checkpoint with a manifest only copies
# bytes and never imports it; otherwise its import overlaps the copy in a thread.


def write_weight_part(
    source,
    out_dir: Path,
    config,
    part: tuple[int, int] = (0, 1),
    dtype=None,
    max_shard_size: str | int = "5GB",
    memory_budget: str | int = "512MB",
) -> tuple[type, list[str], list[str]]:
    """Part ``part`` = (k, n) of the weights of the model ``config`` describes, from ``source`` into ``out_dir``: n
    processes given the same arguments write every shard once between them, k = 0 the index too
    (safetensors_writer.write_weights). Returns (the model class, the files this call wrote, every weight file of
    the folder)."""
    # from_config edits the config it is given
    model_cls, expected, tied, ignorable = model_skeleton(copy.deepcopy(config))
    refuse_merged_tied(source, tied)
    weights = match_namespace(source.tensors, expected, tied, model_cls.__name__, ignorable)
    written = write_weights(
        source,
        weights.names,
        out_dir,
        max_shard_size=max_shard_size,
        dtype=dtype,
        memory_budget=memory_budget,
        part=part,
    )
    return model_cls, written, weight_files(source, weights.names, max_shard_size, dtype)


@dataclass
class MergeResult:
    output: Path
    files: list[str]
    notes: list[str]
    tensors: int
    bytes: int


def merge_checkpoint(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    base_model: str | None = None,
    dtype=None,
    max_shard_size: str | int = "5GB",
    memory_budget: str | int = "512MB",
    overwrite: bool = False,
    verify: bool = False,
    adapter_only: bool = False,
    log=print,
    output_purpose: str | None = None,
    config_fallback: str | None = None,
) -> MergeResult:
    """Turn an FSDP checkpoint into a folder ``from_pretrained`` loads; never leaves a half-written folder.
    ``dtype``: torch.bfloat16 or "bfloat16" casts, None keeps the saved dtype. A PEFT LoRA checkpoint gives the
    base model with the adapter merged in, or with ``adapter_only`` the adapter folder PeftModel loads.
    ``output_purpose``: the output is itself a staging folder of a caller (the final export), and stays marked for
    that purpose (fsdp_recipes.removal) so that only it is ever removed; otherwise the result carries no marker.
    ``config_fallback``: the base model a checkpoint without a config.json takes (the final export's run source).
    The checkpoint's description files are read once (read_files); every later step takes what they say."""
    # needed at the end; checked first
    internals.require("huggingface_hub.serialization._base.parse_size_to_int")
    # a --base-model hub id is read by transformers: a silent hub fails, never hangs
    hub_deadline.install()
    # asked once within the deadline, before transformers' retries of each file (minutes against a silent hub)
    if base_model is not None and (problem := base_model_problem(base_model)):
        raise CheckpointError(problem)
    dtype = dtype_name(dtype)
    resolved = resolve_input(input_path)
    for note in resolved.notes:
        log(note)
    files = read_files(resolved.checkpoint_dir, resolved.places)
    if files.problems:
        raise CheckpointError(files.problems[0])
    if files.config_dir is None and base_model is None:
        base_model = config_fallback
    # with --base-model the config comes from there; the tokenizer files the checkpoint holds are still read
    skip = ("config.json", "generation_config.json") if base_model else ()
    # files the run wrote beside the weights and the copy lacks: not tampered, only gone
    missing: list[str] = []
    if changes := recorded_changes(files, skip, missing):
        raise CheckpointError(changes)
    if missing:
        log(
            f"{resolved.checkpoint_dir} lacks {', '.join(missing)}, which the run wrote there: the merged folder is "
            "made without them (copy them in, or pass --base-model with them)"
        )
    # the real path, as check_output and the staging names use
    restore_interrupted(real(output_path), log)
    out = check_output(input_path, resolved, output_path, overwrite)
    own, base_model = lora_input(resolved, files, base_model, adapter_only, log)
    # read to the end of the merge: never its output
    for base in _base_folders(resolved, base_model):
        if overlap(out, real(base)):
            raise CheckpointError(
                f"output {output_path} {'is' if out == real(base) else 'overlaps'} the base model {base}, which this "
                "merge reads (its config, tokenizer or weights): choose another output"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out, log)
    # A checkpoint our training run wrote carries a manifest: the copy starts from it at once, its description files
    # are copied as they are, and transformers checks config.json against the weights in a thread beside the copy
    # all the same (a manifest is a claim: it may have been edited with its hashes). Otherwise that check comes first.
    from_manifest = None
    if own is None and base_model is None and dtype is None and not isinstance(resolved.source, MergedLoraSource):
        own = from_manifest = described_by_manifest(files, resolved.source.tensors)
    if own is None:
        # no config at all: fail now, not after the copy
        config_origin(files, base_model)
    # a stop or an error leaves without waiting for the check
    with check_pool() as pool:
        future: Future | None = None
        if own is not None:
            weights = own.weights
            if from_manifest is not None:
                future = pool.submit(describe_with_transformers, resolved, files, None, None)
        else:
            future = pool.submit(describe_with_transformers, resolved, files, base_model, dtype)
            # checked before the copy: its ties can refuse it
            lora = isinstance(resolved.source, MergedLoraSource)
            # the copy starts at once on the weights guessed from the stored names and the config's tie; the check
            # beside it has the last word (a wrong guess stops the copy when it is known, and the checked weights
            # are copied again). Waiting for it first put its seconds of imports before every byte of the copy.
            guess = None if lora else guess_weights(resolved.source.tensors, _settings(files, base_model))
            weights = guess or future.result().weights
            if lora:
                refuse_merged_tied(resolved.source, future.result().tied)
        if odd := next(
            (n for n in weights.names.values() if resolved.source.tensors[n].dtype not in DTYPE_SIZES), None
        ):
            raise CheckpointError(
                unconvertible_dtype(resolved.source.tensors[odd].dtype, f"{resolved.checkpoint_dir}: weight {odd!r}")
            )
        size = sum(resolved.source.tensors[n].nbytes(dtype) for n in weights.names.values())
        # the margin: for the description files, and the filesystem's own
        free, margin = shutil.disk_usage(out.parent).free, min(64 << 20, (8 << 20) + size // 8)
        if free < size + margin:
            raise CheckpointError(
                f"not enough free disk space in {out.parent}: the merged weights need {_mb(size)} and a "
                f"{_mb(margin)} margin, {_mb(free)} is free; free space or choose another output"
            )

        # the check beside the copy has failed, or found other weights than guessed
        def wrong_guess() -> bool:
            return (
                future is not None
                and future.done()
                and (future.exception() is not None or future.result().weights.names != weights.names)
            )

        stem = "adapter_model" if adapter_only else "model"
        staging = make_folder(staging_name(out, "tmp"), STAGING)
        made, unmarking = identity(staging), False
        try:
            write = {"max_shard_size": max_shard_size, "dtype": dtype, "memory_budget": memory_budget, "stem": stem}
            try:
                # a child process copies the bytes: this one's GIL belongs to the check's imports meanwhile
                write_weights(
                    resolved.source,
                    weights.names,
                    staging,
                    cancelled=wrong_guess,
                    copy_process=future is not None,
                    **write,
                )
            except Cancelled:
                pass
            # raises the check's error
            described: Description = own if future is None else future.result()
            if from_manifest is not None:
                _agree(from_manifest, described)
                described = from_manifest
            # the guess was wrong: the checked weights, again
            if described.weights.names != weights.names:
                for p in staging.iterdir():
                    if p.name != MARKER:
                        remove_file(staging, p.name, STAGING)
                write_weights(resolved.source, described.weights.names, staging, **write)
            names = described.weights.names
            for note in described.notes:
                log(note)
            log(described.weights.describe())
            log(f"config from {described.origin['config']}, tokenizer from {described.origin['tokenizer']}")
            described.write(staging)
            files = sorted(p.name for p in staging.iterdir() if p.name != MARKER)
            if verify:
                verify_folder(staging, resolved.source, names, dtype, stem=stem)
                log(
                    f"verified: {len(names)} tensors equal the checkpoint"
                    + ("" if adapter_only else "; from_pretrained (meta device) loads the folder")
                )
            # the slow part, while the folder is still ours to remove if stopped
            sync_folder(staging)
            # a caller's staging folder: it stays marked, for that caller to remove
            if output_purpose:
                remark(staging, STAGING, output_purpose)
            # a result: it ships without our marker (stopped before the rename, it is reclaimed below)
            else:
                unmarking = True
                unmark(staging, STAGING)
            sync_entries(staging)
            # check_output: a model folder, and --overwrite was given
            if out.exists():
                old = move(out, staging_name(out, "old"))
                move(staging, out)
                sync_entries(out.parent)
                try:
                    remove(old, STAGING, shape=lambda p: is_model_folder(p) or is_exported_adapter(p))
                # changed while the merge ran (a notes.txt written into it; a mount point)
                except RefusedRemoval:
                    kept = keep_aside(old, out)
                    why = (
                        "changed while the merge ran (it holds "
                        f"{contents(kept)}{', a mount point among them' if mount_points(kept) else ''})"
                    )
                    log(
                        f"warning: the earlier {out} {why}: it is kept whole as {kept.name}; the merged model "
                        f"is in {out}"
                    )
            else:
                move(staging, out)
                sync_entries(out.parent)
        except BaseException:
            for purpose in {STAGING, output_purpose} - {None}:
                if is_ours(staging, purpose):
                    remove(staging, purpose)
            # still here: never moved into place
            if unmarking and reclaim(staging, STAGING, made):
                remove(staging, STAGING)
            raise
    if described.tied:
        log(f"tied weights written once, as save_pretrained does: {', '.join(described.tied)}")
    size = sum(resolved.source.tensors[n].nbytes(dtype) for n in names.values())
    return MergeResult(out, files, resolved.notes, len(names), size)


def _agree(manifest: Description, checked: Description) -> None:
    """The manifest's weights and ties are those transformers finds for config.json and the shards."""
    if manifest.weights.names != checked.weights.names or sorted(manifest.tied) != sorted(checked.tied):
        only = sorted(set(manifest.weights.names) ^ set(checked.weights.names))
        raise CheckpointError(
            f"{MANIFEST} disagrees with config.json and the shards ({len(only)} weight name(s) differ, e.g. "
            f"{only[0] if only else 'the tied weights'}): the checkpoint was edited; restore it, or delete "
            f"{MANIFEST} to merge "
            "what config.json describes"
        )


def _settings(files: CheckpointFiles, base_model: str | None) -> dict | None:
    """The settings of the config.json a merge takes, read without transformers where that is a file (the
    checkpoint's, or a --base-model folder's); None where it is not known here (a hub id, an unreadable file)."""
    if base_model is None:
        return files.config
    try:
        return load_json(Path(base_model) / "config.json", "config.json", JSON_LIMIT)
    # a hub id, a folder without one, a file that is no JSON: transformers says which
    except (ValueError, OSError):
        return None


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _base_folders(resolved: ResolvedInput, base_model: str | None) -> list[Path]:
    """The local base model folders a merge reads besides the checkpoint: --base-model (or the base an adapter config
    names), and the one an adapter-only checkpoint's frozen weights come from."""
    folders = [Path(base_model)] if base_model and Path(base_model).is_dir() else []
    source = resolved.source
    while source is not None:
        if isinstance(source, AdapterOnBaseSource):
            folders.append(source.base_dir)
        source = source.base if isinstance(source, MergedLoraSource) else None
    return folders
