"""What folder the user meant, and which reader opens it.

People point a merge at whatever they have at hand: a run's output folder, one checkpoint-N, the sharded model
folder inside it, or a DCP folder another tool wrote. Failing on any of them but one, or merging a newest
checkpoint that was never finished writing, would cost a user a merge of a broken model or a guess at our
layout. So the input is resolved here once, before anything is read: a run folder gives its newest complete
checkpoint (saying which it skipped and why), an optimizer folder is refused as not weights, and a path that is
none of these gets a hint at the folder that probably was meant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.ckpt.dcp_check import check_folder
from fsdp_recipes.ckpt.layout import DCP_MODEL_DIR, FULL_FILES, checkpoint_steps
from fsdp_recipes.ckpt.readers import DCPSource, SafetensorsSource, TorchBinSource
from fsdp_recipes.ckpt.shard_digests import digest_problems
from fsdp_recipes.errors import CheckpointError, UnknownToThisVersion


def weight_problems(ckpt: Path) -> list[str]:
    """Why a checkpoint-N folder's weights cannot be merged (empty when they can). "Complete" for a merge means
    this: its model weights are all there and readable; optimizer, scheduler and RNG files are not looked at. A
    resume needs all of them (fsdp_recipes.ckpt.status.checkpoint_status, "resumable"). UnknownToThisVersion when
    its metadata names a dtype or class this torch does not know: not a problem of the checkpoint."""
    if (ckpt / DCP_MODEL_DIR).is_dir():
        return check_folder(ckpt / DCP_MODEL_DIR, byte_records=False)[1] or digest_problems(ckpt, (DCP_MODEL_DIR,))
    if any((ckpt / f).is_file() for f in FULL_FILES):
        return []
    return [f"no {DCP_MODEL_DIR}/ and no full weights in {ckpt}"]


@dataclass
class ResolvedInput:
    source: object
    # the checkpoint: where its trainer state lies
    checkpoint_dir: Path
    notes: list[str] = field(default_factory=list)
    # the folder holding the weights, when not checkpoint_dir
    weights_dir: Path | None = None
    # a QLoRA checkpoint merged into its unquantized base: the written config must not say the weights are quantized
    dequantized: bool = False

    @property
    def places(self) -> list[Path]:
        """Where config and tokenizer are looked for, in order: beside the weights, the checkpoint, its parent."""
        found = [self.weights_dir, self.checkpoint_dir, self.checkpoint_dir.parent]
        return [p for i, p in enumerate(found) if p is not None and p not in found[:i]]


def open_source(folder: Path):
    if (folder / DCP_MODEL_DIR).is_dir():
        return DCPSource(folder / DCP_MODEL_DIR)
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        return SafetensorsSource(folder)
    return TorchBinSource(folder / "pytorch_model_fsdp.bin")


def resolve_input(path: str | os.PathLike) -> ResolvedInput:
    """A checkpoint-N folder, a DCP folder (ours, raw torch, Lightning's), or a run folder (its newest checkpoint whose
    weights are complete: see weight_problems)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{p} does not exist: give a checkpoint-N folder, its {DCP_MODEL_DIR} folder, or a run's output folder"
        )
    if not p.is_dir():
        raise CheckpointError(
            f"{p} is a file: give the folder that holds it (a checkpoint-N folder or {DCP_MODEL_DIR})"
        )
    if p.name.startswith("optimizer"):
        raise CheckpointError(
            f"{p} holds optimizer state, not model weights: give {p.parent / DCP_MODEL_DIR} or {p.parent}"
        )
    if (p / ".metadata").is_file() or any(p.glob("*.distcp")):
        # accelerate's model folder belongs to the checkpoint-N around it; any other DCP folder is the checkpoint
        return (
            ResolvedInput(DCPSource(p), p.parent, weights_dir=p)
            if p.name == DCP_MODEL_DIR
            else ResolvedInput(DCPSource(p), p)
        )
    if (p / DCP_MODEL_DIR).is_dir():
        return ResolvedInput(open_source(p), p)
    steps = checkpoint_steps(p)
    if not steps and any((p / f).is_file() for f in FULL_FILES):
        return ResolvedInput(open_source(p), p)
    if steps:
        notes = []
        for ckpt in steps:
            try:
                problems = weight_problems(ckpt)
            # may be complete: never passed over for an older one
            except UnknownToThisVersion as err:
                raise CheckpointError(
                    f"{ckpt.name} in {p} is {err}; or merge an earlier checkpoint-N by its path"
                ) from None
            if not problems:
                notes.append(f"using {ckpt.name}, the newest complete checkpoint in {p}")
                return ResolvedInput(open_source(ckpt), ckpt, notes)
            notes.append(f"skipping {ckpt.name}: {problems[0]}")
        raise CheckpointError(f"no complete checkpoint in {p} ({'; '.join(notes)}): resume training to write one")
    hints = sorted(
        {str(q.parent) for q in p.glob("*/checkpoint-*")}
        | {str(q.parent) for q in p.glob("*/*/.metadata")}
        | {str(q.parent) for q in p.glob("*/.metadata")}
    )
    hint = (
        f"; did you mean {hints[0]}?"
        if hints
        else f"; expected checkpoint-N/ folders, {DCP_MODEL_DIR}/ or a DCP .metadata inside"
    )
    raise CheckpointError(f"{p} is not a checkpoint{hint}")
