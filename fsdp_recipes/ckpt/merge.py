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
from fsdp_recipes.ckpt import base_identity
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
    ADAPTER_CONFIG,
    BASE_IDENTITY,
    MANIFEST,
    is_exported_adapter,
    is_model_folder,
    overlap,
    real,
)
from fsdp_recipes.ckpt.lora_merge import (
    LORA_WEIGHT,
    AdapterOfQuantized,
    AdapterOnBaseSource,
    MergedLoraSource,
    adapter_tensors,
    base_weights,
    find_adapter_config,
    frozen_weight_differs,
    holds_adapter_only,
    is_lora,
    quantized_base,
    read_adapter_config,
)
from fsdp_recipes.ckpt.merge_output import (
    STAGING,
    check_output,
    check_pool,
    remove_stale_staging,
    restore_interrupted,
    staging_name,
)
from fsdp_recipes.ckpt.namespace import WeightMap, guess_weights, match_namespace
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
    model_cls, expected, tied, ignorable = model_skeleton(
        copy.deepcopy(config)
    )  # from_config edits the config it is given
    _refuse_merged_tied(source, tied)
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


def lora_merge_input(ckpt: Path, log=print) -> ResolvedInput:
    """The LoRA checkpoint ``ckpt`` resolved as merge_checkpoint resolves it (its checks included), its source the
    merged weights, read tensor by tensor (MergedLoraSource): for a caller that writes them itself, as the final
    export does, each rank its part (write_weight_part)."""
    resolved = resolve_input(ckpt)
    files = read_files(resolved.checkpoint_dir, resolved.places)
    if files.problems:
        raise CheckpointError(files.problems[0])
    _lora(resolved, files, None, False, log)
    return resolved


def _refuse_merged_tied(source, tied: list[str]) -> None:
    if isinstance(source, MergedLoraSource) and (merged := source.merged_into_tied(tied)):
        raise CheckpointError(
            f"{merged} has a LoRA adapter and is tied to the input embeddings: peft's merge changes both "
            "tensors, this merge writes the tied weight once; merge with peft's merge_and_unload instead"
        )


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
    internals.require("huggingface_hub.serialization._base.parse_size_to_int")  # needed at the end; checked first
    hub_deadline.install()  # a --base-model hub id is read by transformers: a silent hub fails, never hangs
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
    missing: list[str] = []  # files the run wrote beside the weights and the copy lacks: not tampered, only gone
    if changes := recorded_changes(files, skip, missing):
        raise CheckpointError(changes)
    if missing:
        log(
            f"{resolved.checkpoint_dir} lacks {', '.join(missing)}, which the run wrote there: the merged folder is "
            "made without them (copy them in, or pass --base-model with them)"
        )
    restore_interrupted(real(output_path), log)  # the real path, as check_output and the staging names use
    out = check_output(input_path, resolved, output_path, overwrite)
    own, base_model = _lora(resolved, files, base_model, adapter_only, log)
    for base in _base_folders(resolved, base_model):  # read to the end of the merge: never its output
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
        config_origin(files, base_model)  # no config at all: fail now, not after the copy
    with check_pool() as pool:  # a stop or an error leaves without waiting for the check
        future: Future | None = None
        if own is not None:
            weights = own.weights
            if from_manifest is not None:
                future = pool.submit(describe_with_transformers, resolved, files, None, None)
        else:
            future = pool.submit(describe_with_transformers, resolved, files, base_model, dtype)
            lora = isinstance(resolved.source, MergedLoraSource)  # checked before the copy: its ties can refuse it
            # the copy starts at once on the weights guessed from the stored names and the config's tie; the check
            # beside it has the last word (a wrong guess stops the copy when it is known, and the checked weights
            # are copied again). Waiting for it first put its seconds of imports before every byte of the copy.
            guess = None if lora else guess_weights(resolved.source.tensors, _settings(files, base_model))
            weights = guess or future.result().weights
            if lora:
                _refuse_merged_tied(resolved.source, future.result().tied)
        if odd := next(
            (n for n in weights.names.values() if resolved.source.tensors[n].dtype not in DTYPE_SIZES), None
        ):
            raise CheckpointError(
                unconvertible_dtype(resolved.source.tensors[odd].dtype, f"{resolved.checkpoint_dir}: weight {odd!r}")
            )
        size = sum(resolved.source.tensors[n].nbytes(dtype) for n in weights.names.values())
        free, margin = (
            shutil.disk_usage(out.parent).free,
            min(64 << 20, (8 << 20) + size // 8),
        )  # the description files, the filesystem's own
        if free < size + margin:
            raise CheckpointError(
                f"not enough free disk space in {out.parent}: the merged weights need {_mb(size)} and a "
                f"{_mb(margin)} margin, {_mb(free)} is free; free space or choose another output"
            )

        def wrong_guess() -> bool:  # the check beside the copy has failed, or found other weights than guessed
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
            described: Description = own if future is None else future.result()  # raises the check's error
            if from_manifest is not None:
                _agree(from_manifest, described)
                described = from_manifest
            if described.weights.names != weights.names:  # the guess was wrong: the checked weights, again
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
            sync_folder(staging)  # the slow part, while the folder is still ours to remove if stopped
            if output_purpose:  # a caller's staging folder: it stays marked, for that caller to remove
                remark(staging, STAGING, output_purpose)
            else:  # a result: it ships without our marker (stopped before the rename, it is reclaimed below)
                unmarking = True
                unmark(staging, STAGING)
            sync_entries(staging)
            if out.exists():  # check_output: a model folder, and --overwrite was given
                old = move(out, staging_name(out, "old"))
                move(staging, out)
                sync_entries(out.parent)
                try:
                    remove(old, STAGING, shape=lambda p: is_model_folder(p) or is_exported_adapter(p))
                except RefusedRemoval:  # changed while the merge ran (a notes.txt written into it; a mount point)
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
            if unmarking and reclaim(staging, STAGING, made):  # still here: never moved into place
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
    except (ValueError, OSError):  # a hub id, a folder without one, a file that is no JSON: transformers says which
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


def _lora(
    resolved: ResolvedInput, files: CheckpointFiles, base_model: str | None, adapter_only: bool, log
) -> tuple[Description | None, str | None]:
    """A PEFT LoRA checkpoint: its source becomes the merged weights (or, ``adapter_only``, the description of the
    adapter folder is returned). Without a config anywhere, the base model the adapter config names is used when
    it is a local folder. Returns (description or None, base model)."""
    if not is_lora(resolved.source.tensors):
        if adapter_only:
            raise CheckpointError("--adapter-only: this checkpoint holds no LoRA adapter (no lora_A/lora_B weights)")
        return None, base_model
    config_path = find_adapter_config(resolved.places)
    adapter_config = read_adapter_config(config_path)
    recorded = base_identity.read(config_path.parent)  # the base the run trained on, when it recorded one
    alone = holds_adapter_only(
        resolved.source.tensors
    )  # an adapter-only checkpoint: the base's weights are the base model's
    if not alone and (quantized := quantized_base(resolved.source.tensors)):
        resolved.source, alone, resolved.dequantized = AdapterOfQuantized(resolved.source), True, True
        log(f"{quantized}: the adapter is merged into the unquantized base model's weights")
    if alone and not adapter_only:
        base, base_dir = base_weights(base_model, adapter_config, config_path)
        if recorded is None:
            log(
                f"no {BASE_IDENTITY} beside {config_path.name} (a checkpoint of an older run or of another "
                "tool): the base "
                f"model {base_dir} is not checked against the one the adapter was trained on"
            )
        elif problem := base_identity.base_problem(
            recorded,
            base_dir,
            str(config_path.parent),
            (
                "pass --base-model <the base it was trained on> (to merge into another base on purpose, move "
                f"{BASE_IDENTITY} away)"
            ),
        ):
            raise CheckpointError(problem)
        resolved.source = AdapterOnBaseSource(resolved.source, base, base_dir)
        if isinstance(resolved.source.adapter, AdapterOfQuantized) and (
            differs := frozen_weight_differs(resolved.source.adapter.source, resolved.source)
        ):
            raise CheckpointError(
                f"{differs} in the checkpoint differs from the base model {base_dir}'s: it is another model than the "
                "one the adapter was trained on (or the run trained that weight); give its base with --base-model"
            )
        log(f"adapter-only LoRA checkpoint: the frozen base's weights from {base_dir}")
    merged = None if alone and adapter_only else MergedLoraSource(resolved.source, adapter_config)
    if adapter_only:
        names = adapter_tensors(resolved.source)
        adapter = merged.adapter if merged else LORA_WEIGHT.match(next(iter(names.values())))["adapter"]
        origin = {"config": str(config_path), "tokenizer": "(none: an adapter folder)"}
        log(
            f"PEFT LoRA checkpoint: writing adapter {adapter!r} ({len(names)} tensors) as "
            "PeftModel.from_pretrained loads it"
        )

        def write(out: Path) -> None:
            shutil.copyfile(config_path, out / ADAPTER_CONFIG)
            if recorded is not None:  # checked as a record above; the adapter folder keeps naming its base
                base_identity.write(out, recorded)

        return Description(
            WeightMap(names, "", len(resolved.source.tensors) - len(names)), [], origin, write
        ), base_model
    resolved.source = merged
    log(
        f"PEFT LoRA checkpoint: merging adapter {merged.adapter!r} ({len(merged.pairs)} modules, lora_alpha "
        f"{merged.alpha:g}{', rsLoRA' if merged.rslora else ''}) into the base weights, as merge_and_unload does"
    )
    named = adapter_config.get("base_model_name_or_path")
    if base_model is None and files.config_dir is None and named and (Path(named) / "config.json").is_file():
        log(f"config from the base model {ADAPTER_CONFIG} names: {named}")
        return None, named
    return None, base_model
