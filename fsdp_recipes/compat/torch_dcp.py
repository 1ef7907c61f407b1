"""The patch of torch's DCP reader that makes every DCP load in this process unpickle only what our allow-lists vetted.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle`` and
``DefaultLoadPlanner.load_bytes`` loads every byte record with ``torch.load(weights_only=False)``: a checkpoint
from anywhere could run any code it names as soon as a resume (accelerate's load) or a merge reads it. Checking
each folder before it is loaded is not enough on its own: a code path that forgot the check, or a file changed
between the check and the load, would go through unvetted. So the reader itself is patched, once per process,
to hand the bytes it read to the vetting functions it is given (fsdp_recipes.ckpt.dcp_pickles's, the one reader of
DCP pickles, with the allow-lists: ``dcp_pickles.guard_torch_dcp`` installs them) and to go on only with what they
return.
The patching lives here, with the other patches of libraries' private symbols (each registered in
fsdp_recipes/compat/internals.py); the judging of bytes stays in ckpt/dcp_pickles.py, which compat does not import.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.bounded import read_bytes
from fsdp_recipes.compat import internals
from fsdp_recipes.errors import CheckpointError, UnreadableFile

_guarded: list[bool] = []


def install(vetted_metadata, vetted_byte_record, metadata_limit: int) -> None:
    """From now on in this process, torch's DCP reader unpickles nothing these have not vetted: the ``.metadata`` it
    reads (a regular file of at most ``metadata_limit`` bytes, read by fsdp_recipes.bounded: it may have changed since
    it was checked) becomes ``vetted_metadata(data, path, folder)`` (the Metadata, unpickled from vetted bytes), and
    every byte record ``vetted_byte_record(stream, key)`` (a stream torch's own loader then reads). Idempotent."""
    if _guarded:
        return
    metadata_path = internals.get("torch.distributed.checkpoint.filesystem.FileSystemReader._get_metadata_path")
    load_bytes = internals.get("torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes")

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = metadata_path(self, kwargs.get("rank"))
        # a FIFO or a larger file put there since the checks would hang the read or fill memory
        try:
            data = read_bytes(path, ".metadata", metadata_limit)
        except UnreadableFile as err:
            raise CheckpointError(
                f"{path} is not a regular file of at most {metadata_limit:,} bytes as checked ({err.reason}): "
                "copy the checkpoint again"
            ) from None
        metadata = vetted_metadata(data, path, Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def vetted_load_bytes(self, read_item, value):
        return load_bytes(self, read_item, vetted_byte_record(value, read_item.dest_index.fqn))

    internals.patch("torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata", read_metadata)
    internals.patch("torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes", vetted_load_bytes)
    _guarded.append(True)
