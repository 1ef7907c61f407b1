"""The final export written by every rank in parallel: each rank its shards and a completion file (write_part),
rank 0 waiting on those files without a collective, so without a deadline on the writing (wait_for_parts), then
publishing the folder and recording the export in the run's report (publish_parts).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json, read_text
from fsdp_recipes.ckpt.layout import EXPORT_STAGING, REPORT_NAME
from fsdp_recipes.ckpt.merge import write_weight_part
from fsdp_recipes.ckpt.readers import dtype_name
from fsdp_recipes.errors import CheckpointError, UnreadableFile
from fsdp_recipes.removal import replace_file
from fsdp_recipes.train.model_folder import publish, publish_adapter
from fsdp_recipes.train.run_report import update_run_report

logger = logging.getLogger("fsdp_recipes.train.export")

# Every shard of the final export is at most 5 GB (save_pretrained's default) and, above this size, about 1/N of the
# model, so that N ranks each write a share; a smaller model is written in fewer, larger shards.
PART_MIN_BYTES = 64 << 20
PART_MAX_BYTES = 5 * 10**9
# how often rank 0 looks for the other ranks' completion files
PART_POLL_SECONDS = 1.0
# a part's .failed message or .alive heartbeat: one line
PART_NOTE_LIMIT = 64 << 10
# how often it says whom it is waiting for
PART_LOG_SECONDS = 60.0
# A writing rank rewrites .part-K.alive (a counter) from a thread every PART_BEAT_SECONDS, however slow its writes;
# rank 0 gives up on a rank whose counter has not changed for PART_STALE_SECONDS by its own clock (no clock is
# compared across machines): a rank on another node that died or hangs, where no launcher stops rank 0 for it.
PART_BEAT_SECONDS = 10.0
PART_STALE_SECONDS = 300.0


def part_shard_size(total: int, world: int) -> int:
    """The largest shard of an export of ``total`` bytes by ``world`` ranks: every rank gets a shard when it can."""
    return min(PART_MAX_BYTES, max(PART_MIN_BYTES, -(-total // max(world, 1))))


def publish_parts(staging: Path, out: Path, world: int, weight_names: list, describe, dtype, started, adapter=None):
    """Rank 0's end of a parallel export: every rank's part written (wait_for_parts) and every weight file there, the
    description written (``describe(staging)``: the names of its files), ``out/model/`` published, then a LoRA run's
    staged ``adapter`` folder (nothing of this export is published when a part is missing), and the export recorded
    in the run's fsdp_report.json (writers: the ranks that wrote a file). Returns that record."""
    parts = wait_for_parts(staging, world, log=logger.info)
    if missing := [n for n in weight_names if not (staging / n).is_file()]:
        raise CheckpointError(
            f"the final export finished without {', '.join(missing[:3])} in {staging}: nothing was published; "
            "run the same command with --resume_from_checkpoint true to export the last checkpoint again"
        )
    described = describe(staging)
    size = sum((staging / n).stat().st_size for n in weight_names if n.endswith(".safetensors"))
    publish(staging, out, sorted(set(weight_names) | set(described)))
    if adapter is not None:
        publish_adapter(adapter, out)
    seconds = round(time.monotonic() - started, 3)
    writers = sum(1 for p in parts.values() if p["files"])
    record = {
        "dtype": dtype,
        "writers": writers,
        "shards": sum(n.endswith(".safetensors") for n in weight_names),
        "bytes": size,
        "seconds": seconds,
        "ranks": {str(r): p for r, p in sorted(parts.items())},
    }
    record_export(out, record)
    logger.info(
        f"final model: {size / 1e6:,.1f} MB in {dtype}, written by {writers} of {world} rank(s) in parallel in "
        f"{seconds:.1f} s (fsdp_report.json: export)"
    )
    return record


def write_part(source, staging: Path, config, part: tuple[int, int], dtype, max_shard_size: int | None = None):
    """This rank's shards of the final folder into ``staging``, then its completion file: ``.part-K.done`` (the files
    and the seconds it took), or ``.part-K.failed`` (the error) before the error goes on up. ``source``: a checkpoint
    source, or a function that opens one (its errors are this rank's failure too). ``max_shard_size``: by default
    part_shard_size of the source's bytes (in ``dtype``) and the part's rank count. Returns what write_weight_part
    returns."""
    rank, started, stop = part[0], time.monotonic(), threading.Event()

    def beat():
        count = 0
        while True:
            count += 1
            (staging / f".part-{rank}.alive").write_text(f"{count}\n")
            if stop.wait(PART_BEAT_SECONDS):
                return

    beating = threading.Thread(target=beat, name="export-heartbeat", daemon=True)
    beating.start()
    try:
        if callable(source):
            source = source()
        if max_shard_size is None:
            size = sum(info.nbytes(dtype_name(dtype)) for info in source.tensors.values())
            max_shard_size = part_shard_size(size, part[1])
        result = write_weight_part(source, staging, config, part, dtype, max_shard_size)
    except BaseException as err:
        (staging / f".part-{rank}.failing").write_text(f"{type(err).__name__}: {err}"[:2000] + "\n")
        # whole: rank 0 reads it
        replace_file(staging / f".part-{rank}.failing", staging / f".part-{rank}.failed", EXPORT_STAGING)
        raise
    finally:
        stop.set()
        beating.join()
    record = {"files": result[1], "seconds": round(time.monotonic() - started, 3)}
    (staging / f".part-{rank}.tmp").write_text(json.dumps(record) + "\n")
    # whole, or absent
    replace_file(staging / f".part-{rank}.tmp", staging / f".part-{rank}.done", EXPORT_STAGING)
    return result


def wait_for_parts(staging: Path, world: int, log=print) -> dict[int, dict]:
    """Rank 0's wait for every rank's completion file, without a collective and so without a deadline on the writing:
    one that fails leaves ``.part-K.failed``, raised here; one that dies ends the launch on its machine (torch
    elastic stops the others), and one whose heartbeat (``.part-K.alive``) stops changing for PART_STALE_SECONDS
    is given up on, on any machine."""
    parts: dict[int, dict] = {}
    last_said = time.monotonic()
    # last seen, when
    beats: dict[int, tuple[str | None, float]] = dict.fromkeys(range(world), (None, last_said))
    again = (
        "nothing was published; run the same command with --resume_from_checkpoint true to export the last checkpoint"
    )
    while len(parts) < world:
        for rank in sorted(set(range(world)) - set(parts)):
            failed, done = staging / f".part-{rank}.failed", staging / f".part-{rank}.done"
            # in any form (a FIFO put there is named, not waited on)
            if os.path.lexists(failed):
                try:
                    why = read_text(failed, failed.name, PART_NOTE_LIMIT).strip()
                except UnreadableFile as err:
                    why = str(err)
                raise CheckpointError(f"rank {rank} failed writing its part of the final model ({why}): {again}")
            if os.path.lexists(done):
                try:
                    parts[rank] = load_json(done, done.name, JSON_LIMIT)
                except UnreadableFile as err:
                    raise CheckpointError(
                        f"rank {rank}'s record of its part of the final model: {err}; {again}"
                    ) from None
                files = parts[rank].get("files")
                if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
                    raise CheckpointError(
                        f"rank {rank}'s record of its part of the final model ({done}) names no list of files: {again}"
                    )
                continue
            try:
                beat = read_text(staging / f".part-{rank}.alive", f".part-{rank}.alive", PART_NOTE_LIMIT)
            except (OSError, UnreadableFile):
                beat = None
            if beat != beats[rank][0]:
                beats[rank] = (beat, time.monotonic())
            elif time.monotonic() - beats[rank][1] > PART_STALE_SECONDS:
                raise CheckpointError(
                    f"rank {rank} has shown no sign of life for {PART_STALE_SECONDS:.0f} s while writing its part "
                    f"of the final model ({staging / f'.part-{rank}.alive'} stopped changing): it died or "
                    f"hangs; {again}"
                )
        if len(parts) < world:
            if time.monotonic() - last_said >= PART_LOG_SECONDS:
                log(
                    "final model: waiting for rank(s) "
                    f"{', '.join(str(r) for r in sorted(set(range(world)) - set(parts)))} "
                    "to finish their shards (no timeout applies)"
                )
                last_said = time.monotonic()
            time.sleep(PART_POLL_SECONDS)
    return parts


def record_export(out: Path, export: dict) -> None:
    """The export's dtype, writers and time in the run's fsdp_report.json (rank 0; the report is the run's, when it
    exists)."""
    path = Path(out) / REPORT_NAME
    if path.is_file():
        update_run_report(path, lambda report: report.update(export=export))
