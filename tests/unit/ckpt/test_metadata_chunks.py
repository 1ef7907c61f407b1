"""A DCP ``.metadata`` says which chunk of each tensor lies where; every reader trusts those offsets. Chunks that do
not make up their tensor exactly (two claiming the same rows, a gap, one outside the tensor, one no record holds)
gave silently wrong weights: check_checkpoint said resumable, the merge (with --verify) wrote rows of zeros and
exited 0, a resume loaded them. Now fsdp_recipes.ckpt.dcp_check.check_folder, which every reader goes through, refuses
them in one line. The class is tested by generating every one-step damage of valid layouts (moved, grown, shrunk,
duplicated or dropped chunks, a record dropped), and on a real 2-rank checkpoint's files."""

from __future__ import annotations

import itertools
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import cli, one_line_error, run_dir  # noqa: F401 (run_dir: the fixture)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from fsdp_recipes.ckpt.dcp_check import chunk_problems, record_size_problems
from fsdp_recipes.ckpt.dcp_layout import Chunk, Layout, Stored, TensorEntry
from fsdp_recipes.ckpt.resume import resolve_resume
from fsdp_recipes.errors import RecipeError

META = Path("/ckpt/.metadata")

# layouts writers make: (shape, [(offsets, sizes)])
VALID = {
    "rows over 3 ranks, uneven": ((10, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((8, 0), (2, 4))]),
    "rows, listed out of order": ((9, 2), [((6, 0), (3, 2)), ((0, 0), (3, 2)), ((3, 0), (3, 2))]),
    "an empty chunk (a rank with no rows)": ((3, 5), [((0, 0), (3, 5)), ((3, 0), (0, 5))]),
    "a 2 x 2 grid (FSDP x tensor parallel)": (
        (6, 8),
        [((0, 0), (3, 4)), ((0, 4), (3, 4)), ((3, 0), (3, 4)), ((3, 4), (3, 4))],
    ),
    "a tiling that is no grid": ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 1)), ((2, 1), (2, 3))]),
    "a 1-d tensor": ((7,), [((0,), (4,)), ((4,), (3,))]),
    "a scalar": ((), [((), ())]),
    "a whole tensor in one chunk": ((5, 3), [((0, 0), (5, 3))]),
}


def layout(shape, chunks, drop_record=None) -> Layout:
    entry = TensorEntry("float32", tuple(shape), tuple(Chunk(tuple(o), tuple(s)) for o, s in chunks))
    storage = {("w", tuple(o)): Stored("__0_0.distcp", 0, 10**9, False) for o, _ in chunks if tuple(o) != drop_record}
    return Layout({"w": entry}, storage)


@pytest.mark.parametrize("name", VALID)
def test_layouts_writers_make_are_taken(name):
    assert chunk_problems(layout(*VALID[name]), META) == []


def damaged(shape, chunks):
    """Every one-step damage of a valid layout: a chunk moved or grown by one along a dimension, shrunk by one,
    duplicated, dropped; each makes the chunks no longer the tensor."""
    for i, (offsets, sizes) in enumerate(chunks):
        # an empty chunk holds nothing: moving it changes nothing
        if 0 in sizes:
            continue
        others = chunks[:i] + chunks[i + 1 :]
        for d in range(len(shape)):
            for step in (-1, 1):
                moved = tuple(o + step if k == d else o for k, o in enumerate(offsets))
                yield f"chunk {i} moved {step:+d} along dim {d}", [*others, (moved, sizes)]
            grown = tuple(n + 1 if k == d else n for k, n in enumerate(sizes))
            yield f"chunk {i} grown along dim {d}", [*others, (offsets, grown)]
            shrunk = tuple(n - 1 if k == d else n for k, n in enumerate(sizes))
            yield f"chunk {i} shrunk along dim {d}", [*others, (offsets, shrunk)]
        yield f"chunk {i} twice", [*chunks, (offsets, sizes)]
        if shape:
            yield f"chunk {i} dropped", others
        yield f"chunk {i} with one dimension more", [*others, ((*offsets, 0), (*sizes, 1))]


CASES = [(name, how, shape, chunks) for name, (shape, ok) in VALID.items() for how, chunks in damaged(shape, ok)]


@pytest.mark.parametrize("name,how,shape,chunks", CASES, ids=[f"{n}: {h}" for n, h, *_ in CASES])
def test_every_one_step_damage_of_a_valid_layout_is_refused(name, how, shape, chunks):
    problems = chunk_problems(layout(shape, chunks), META)
    assert len(problems) == 1 and problems[0].startswith(f"unreadable {META}: the chunks of 'w' "), problems
    assert "so they do not make up the tensor" in problems[0] and "use another checkpoint-N" in problems[0]


@pytest.mark.parametrize("name", [n for n in VALID if VALID[n][0]])
def test_a_chunk_without_a_record_is_refused(name):
    shape, chunks = VALID[name]
    problems = chunk_problems(layout(shape, chunks, drop_record=tuple(chunks[-1][0])), META)
    assert len(problems) == 1 and "that no record holds" in problems[0], problems


@pytest.mark.parametrize("name", [n for n in VALID if VALID[n][0]])
def test_a_record_smaller_than_its_chunk_is_refused(name):
    """A plain record holds at least its chunk's bytes: chunks of 200 and 274 rows over records of 237 rows each are
    refused by the check, not left for the merge to fail on."""
    import math

    shape, chunks = VALID[name]
    built = layout(shape, chunks)
    offsets, sizes = next((o, s) for o, s in chunks if math.prod(s))
    stored = built.storage[("w", tuple(offsets))]
    built.storage[("w", tuple(offsets))] = Stored(stored.relative_path, 0, math.prod(sizes) * 4 - 1, False)
    # the tiling is sound: the record's size is checked after the vetting
    assert chunk_problems(built, META) == []
    problems = record_size_problems(built, META)
    assert len(problems) == 1 and f"bytes, fewer than its {math.prod(sizes) * 4:,}" in problems[0], problems
    # compressed: torch decodes it
    built.storage[("w", tuple(offsets))] = Stored(stored.relative_path, 0, 1, True)
    assert record_size_problems(built, META) == []


@pytest.fixture
def walked(monkeypatch) -> list:
    """The grid cells chunk_problems walks, one entry per chunk it walks (its itertools.product calls): a layout
    refused by its count is refused before any."""
    from fsdp_recipes.ckpt import dcp_check

    calls, product = [], dcp_check.itertools.product

    def counting(*ranges):
        calls.append(ranges)
        return product(*ranges)

    monkeypatch.setattr(dcp_check.itertools, "product", counting)
    return calls


def test_a_brick_layout_is_refused_by_its_count_before_any_cell_is_walked(walked):
    """Staggered rows (a brick wall) tile the tensor with 2,000 chunks but cut it into ~10^6 grid cells (1.6 s a
    tensor to walk, minutes over a file of them): refused by its count, without walking one."""
    n, chunks = 1000, []
    for row in range(n):
        # a different cut in every row
        cut = 1 + (row * 7919) % (n - 1)
        chunks += [((row, 0), (1, cut)), ((row, cut), (1, n - cut))]
    problems = chunk_problems(layout((n, n), chunks), META)
    assert len(problems) == 1 and "pieces, more than any writer's layout of 2,000 chunks" in problems[0], problems
    assert walked == []


def test_a_layout_cut_finer_than_any_writer_cuts_is_refused_not_walked(walked):
    """A made-up layout whose edges cut a tensor into far more grid cells than it has chunks: refused by counting
    them, not walked; a writer's layout of as many chunks is walked and taken."""
    n = 1100
    # 1100 row chunks and one column cut: edges 1101 x 3
    rows = [((i, 0), (1, n)) for i in range(n)]
    chunks = rows[:-1] + [((n - 1, 0), (1, 1)), ((n - 1, 1), (1, n - 1))]
    # 2,200 cells: walked and taken
    assert chunk_problems(layout((n, n), chunks), META) == []
    assert len(walked) == len(chunks)
    walked.clear()
    columns = [((i, 0), (1, i + 1)) for i in range(n)] + [((i, i + 1), (1, n - i - 1)) for i in range(n - 1)]
    problems = chunk_problems(layout((n, n), columns), META)
    assert len(problems) == 1 and "pieces, more than any writer's layout" in problems[0], problems
    assert walked == []


def rewrite_chunks(folder: Path, key: str, change) -> None:
    """Rewrite ``folder``'s .metadata (with DCP's own classes, as another tool would) so that ``key``'s chunks are
    ``change(chunks)``; each new chunk's record is the one of the chunk it replaced, re-keyed to its offsets."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    entry = metadata.state_dict_metadata[key]
    before = list(entry.chunks)
    after = change(before)
    records = {tuple(i.offset): info for i, info in metadata.storage_data.items() if i.fqn == key}
    metadata.storage_data = {i: info for i, info in metadata.storage_data.items() if i.fqn != key}
    for old, new in zip(itertools.cycle(before), after):
        metadata.storage_data[MetadataIndex(key, new.offsets)] = records[tuple(old.offsets)]
    entry.chunks = after
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


# rank 1's chunk claims rank 0's offsets
def same_offsets(chunks):
    return [chunks[0], ChunkStorageMetadata(offsets=chunks[0].offsets, sizes=chunks[1].sizes)]


# rank 0's chunk a row longer, rank 1's a row shorter: as many elements, one row twice, one none
def one_row_over(chunks):
    first, second = chunks
    return [
        ChunkStorageMetadata(offsets=first.offsets, sizes=torch.Size([first.sizes[0] + 1, *first.sizes[1:]])),
        ChunkStorageMetadata(offsets=second.offsets, sizes=torch.Size([second.sizes[0] - 1, *second.sizes[1:]])),
    ]


def half_missing(chunks):
    return chunks[:1]


@pytest.mark.parametrize("folder", ["pytorch_model_fsdp_0", "optimizer_0"])
@pytest.mark.parametrize("change", [same_offsets, one_row_over, half_missing], ids=lambda f: f.__name__)
def test_a_real_checkpoints_metadata_whose_chunks_do_not_make_the_tensor_is_refused_by_every_reader(
    run_dir,  # noqa: F811 (the fixture)
    folder,
    change,
    tmp_path,
    capsys,  # noqa: F811 (the fixture)
):
    ckpt = run_dir / "checkpoint-12"
    meta = dcp.FileSystemReader(str(ckpt / folder)).read_metadata()
    key = next(
        k for k, m in meta.state_dict_metadata.items() if hasattr(m, "chunks") and "lm_head" in k and len(m.chunks) == 2
    )
    rewrite_chunks(ckpt / folder, key, change)

    assert cli("check_checkpoint", [str(ckpt)]) == 1
    said = capsys.readouterr().out
    assert (
        f"the chunks of {key!r}" in said and "do not make up the tensor" in said and len(said.strip().splitlines()) == 1
    ), said
    # the merge reads the model's folder only
    if folder == "pytorch_model_fsdp_0":
        for argv in (
            [str(ckpt), str(tmp_path / "out")],
            [str(ckpt), str(tmp_path / "out"), "--verify"],
            [str(ckpt), "--inspect"],
        ):
            assert cli("merge_checkpoint", argv) == 1
            err = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
            assert f"the chunks of {key!r}" in err, err
        assert not (tmp_path / "out").exists()
    with pytest.raises(RecipeError, match="cannot resume from checkpoint-12 .*do not make up the tensor"):
        resolve_resume(str(ckpt), str(run_dir))


def test_the_real_checkpoint_before_the_edit_is_taken(run_dir, capsys):  # noqa: F811
    assert cli("check_checkpoint", [str(run_dir / "checkpoint-12")]) == 0, capsys.readouterr().out


def test_shard_folders_copied_in_from_another_checkpoint_with_their_digests_are_refused(trained, tmp_path, capsys):
    """checkpoint-6's shard folders and shard_digests.json copied into checkpoint-12: every digest matches its file,
    yet a resume would write step 6's weights as step 12's model. The digests record their step (and each folder's
    .metadata): the copy is named by every reader."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    source = trained("accelerate_configs/zero3.yaml").output_dir
    run = tmp_path / "run"
    for name in ("checkpoint-6", "checkpoint-12"):
        shutil.copytree(source / name, run / name)
    assert checkpoint_status(run / "checkpoint-12").resumable
    recorded = json.loads((run / "checkpoint-12" / "shard_digests.json").read_text())
    assert recorded["step"] == 12 and {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= set(
        recorded["files"]
    )
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        shutil.rmtree(run / "checkpoint-12" / name)
        shutil.copytree(run / "checkpoint-6" / name, run / "checkpoint-12" / name)
    shutil.copy(run / "checkpoint-6" / "shard_digests.json", run / "checkpoint-12" / "shard_digests.json")

    wanted = (
        "shard_digests.json is that of step 6, and this checkpoint is of step 12: its shard folders were "
        "copied from another checkpoint"
    )
    assert cli("check_checkpoint", [str(run / "checkpoint-12")]) == 1
    said = capsys.readouterr().out
    assert wanted in said and len(said.strip().splitlines()) == 1, said
    assert cli("merge_checkpoint", [str(run / "checkpoint-12"), str(tmp_path / "out")]) == 1
    assert wanted in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert not (tmp_path / "out").exists()
    with pytest.raises(RecipeError, match="cannot resume from checkpoint-12 .*that of step 6"):
        resolve_resume(str(run / "checkpoint-12"), str(run))

    # without the digests: no record, so the manifest's announcement
    (run / "checkpoint-12" / "shard_digests.json").unlink()
    assert "missing shard_digests.json" in "; ".join(checkpoint_status(run / "checkpoint-12").problems)


@pytest.mark.parametrize("manifest", ["its own", "checkpoint-6's"])
@pytest.mark.parametrize("digests", ["checkpoint-6's", "checkpoint-6's without a step", "its own without a step"])
def test_shard_folders_copied_in_with_digests_of_any_form_are_refused(trained, tmp_path, digests, manifest):
    """checkpoint-6's shard folders copied into checkpoint-12 with digests of an older version (no step) are refused
    too. The manifest is sealed with the step its digests record, so a record of no step or another step is
    named whichever manifest came along; a checkpoint renamed (best) with its own files is still taken."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    source = trained("accelerate_configs/zero3.yaml").output_dir
    ckpt = tmp_path / "run" / "checkpoint-12"
    shutil.copytree(source / "checkpoint-12", ckpt)
    sealed = json.loads((ckpt / "model_description.json").read_text())
    assert sealed["shard_digests_step"] == 12
    shutil.copytree(ckpt, tmp_path / "run" / "best")
    # renamed: its step is its trainer_state.json's
    assert checkpoint_status(tmp_path / "run" / "best").resumable

    older = source / "checkpoint-6"
    if digests.startswith("checkpoint-6"):
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            shutil.rmtree(ckpt / name)
            shutil.copytree(older / name, ckpt / name)
    record = json.loads(((older if digests.startswith("checkpoint-6") else ckpt) / "shard_digests.json").read_text())
    if digests.endswith("without a step"):
        # as this repository wrote them before the digests named their step
        del record["step"]
    (ckpt / "shard_digests.json").write_text(json.dumps(record))
    if manifest == "checkpoint-6's":
        shutil.copy(older / "model_description.json", ckpt / "model_description.json")
    problems = "; ".join(checkpoint_status(ckpt).problems)
    whose = "of no step (an older version's)" if digests.endswith("without a step") else "that of step 6"
    assert f"shard_digests.json is {whose}, and this checkpoint is of step " in problems, problems


@pytest.mark.parametrize("where", ["shard_digests.json", "model_description.json"])
@pytest.mark.parametrize("value", [True, 12.0, "12", -1, None])
def test_a_recorded_step_that_is_no_step_number_is_named(trained, tmp_path, where, value):
    """True is no step 1 and 12.0 no step 12; a manifest's step of another type is named, not ignored (removing or
    retyping it in both records would let an older version's digests through). A record without its step (None: removed)
    is named too while the other record has one."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    ckpt = tmp_path / "checkpoint-12"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", ckpt)
    key = "step" if where == "shard_digests.json" else "shard_digests_step"
    record = json.loads((ckpt / where).read_text())
    if value is None:
        del record[key]
    else:
        record[key] = value
    (ckpt / where).write_text(json.dumps(record))
    problems = "; ".join(checkpoint_status(ckpt).problems)
    if value is None:
        assert "shard_digests.json is of no step" in problems if key == "step" else checkpoint_status(ckpt).resumable, (
            problems
        )
    else:
        assert (
            f"{'shard_digests.json' if key == 'step' else 'model_description.json'}" in problems
            and "not a step number" in problems
        ), problems


def test_a_renamed_checkpoint_is_named_as_renamed_not_as_a_copy(trained, tmp_path, capsys):
    """checkpoint-12 renamed checkpoint-13 is named as renamed, not as shard folders copied from another checkpoint.
    Every record agrees on step 12 but the name: it says so, and the fix."""
    ckpt = tmp_path / "checkpoint-13"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", ckpt)
    wanted = (
        "checkpoint-13 was renamed: its trainer_state.json, shard_digests.json and model_description.json "
        "are of step 12; give it back its name checkpoint-12"
    )
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")]) == 1
    assert wanted in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert not (tmp_path / "out").exists()


def test_an_edited_metadata_of_our_own_checkpoint_is_named_by_its_digest(run_dir, capsys):  # noqa: F811
    """.metadata is in shard_digests.json: an edit that keeps the chunks a valid layout (here: a tensor's dtype
    renamed) is not the file the checkpoint wrote."""
    folder = run_dir / "checkpoint-12" / "pytorch_model_fsdp_0"
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    key = next(k for k, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks"))
    metadata.state_dict_metadata[key].properties.dtype = torch.float16
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert cli("check_checkpoint", [str(run_dir / "checkpoint-12")]) == 1
    assert "pytorch_model_fsdp_0/.metadata is not the file this checkpoint wrote" in capsys.readouterr().out
