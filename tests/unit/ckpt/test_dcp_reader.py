"""The torch-free DCP reader the merge copies with: same answers as torch's, and it falls back to torch when unsure."""

from __future__ import annotations

import io
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run

from fsdp_recipes.ckpt.dcp_layout import UnsafeCheckpointError, layout_from
from fsdp_recipes.ckpt.dcp_pickles import _MetadataUnpickler, raw_tensor, read_layout
from fsdp_recipes.ckpt.readers import DCPSource
from fsdp_recipes.ckpt.torch_save_archive import FileSlice


def torch_layout(folder: Path):
    return layout_from(dcp.FileSystemReader(str(folder)).read_metadata())


def record_tensor(folder: Path, stored) -> torch.Tensor:
    with open(folder / stored.relative_path, "rb") as f:
        return torch.load(FileSlice(f, stored.offset, stored.length), weights_only=True)


@pytest.mark.parametrize("config", ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"])
def test_layout_and_raw_bytes_match_torch_on_real_checkpoints(trained, config):
    """Every chunk of a real FSDP2 and FSDP1 checkpoint is found where torch.load finds it, byte for byte."""
    folder = trained(config).output_dir / "checkpoint-12" / "pytorch_model_fsdp_0"
    layout = read_layout(folder)
    assert layout == torch_layout(folder)
    assert len(layout.tensors) == 39 and all(len(t.chunks) == 2 for t in layout.tensors.values())
    for stored in layout.storage.values():
        raw = raw_tensor(folder, stored)
        # the fast path is the one taken on real checkpoints
        assert raw is not None, stored
        expected = record_tensor(folder, stored)
        with open(folder / stored.relative_path, "rb") as f:
            f.seek(raw.data_offset)
            data = f.read(raw.nbytes)
        assert (raw.dtype, raw.shape) == (str(expected.dtype).removeprefix("torch."), tuple(expected.shape))
        assert data == expected.contiguous().view(torch.uint8).numpy().tobytes()


def test_merge_copies_without_importing_torch(trained, tmp_path):
    """Planning and copying a whole checkpoint leaves torch unimported (its import is the time we save)."""
    ckpt = trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12"
    code = (
        "import sys\nfrom pathlib import Path\nfrom fsdp_recipes.ckpt.readers import DCPSource\nfrom "
        "fsdp_recipes.ckpt.safetensors_writer import write_weights\n"
        f"src = DCPSource(Path({str(ckpt / 'pytorch_model_fsdp_0')!r}))\n"
        "assert all(src.copy_plan(n) for n in src.tensors)\n"
        f"write_weights(src, sorted(src.tensors), Path({str(tmp_path)!r}))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    proc = run(["python", "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    source = DCPSource(ckpt / "pytorch_model_fsdp_0")
    from safetensors.torch import load_file

    written = load_file(tmp_path / "model.safetensors")
    expected = source.read(sorted(source.tensors))
    assert all(torch.equal(written[n], expected[n]) for n in expected)


def test_metadata_naming_other_classes(trained, tmp_path):
    """A .metadata naming a DCP dataclass or enum we have no stand-in for (another torch version's metadata) is
    read; one naming anything else, however harmless, is refused and never handed to a plain unpickler."""
    folder = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(
        trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12" / "pytorch_model_fsdp_0", folder
    )
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType

    metadata.planner_data = {"kinds": [WriteItemType.TENSOR, LoadItemType.BYTE_IO], "written": Path("/somewhere")}
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    assert read_layout(folder) == torch_layout(folder)
    assert len(read_layout(folder).tensors) == 39
    metadata.planner_data = {"when": __import__("datetime").date(2026, 11, 22)}
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match="datetime.date"):
        read_layout(folder)
    with pytest.raises(UnsafeCheckpointError, match="datetime.date"):
        _MetadataUnpickler(io.BytesIO((folder / ".metadata").read_bytes())).load()


def test_records_that_are_not_plain_bytes_go_to_torch(tmp_path):
    """A transposed tensor is stored with its strides: no raw copy; it is read through torch, correctly."""
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"t": a.T, "c": a.clone(), "h": a.to(torch.bfloat16), "s": a[1:]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(tmp_path), no_dist=True)
    source = DCPSource(tmp_path)
    assert source.copy_plan("model.t") is None
    assert all(source.copy_plan(f"model.{n}") is not None for n in ("c", "h", "s"))
    for name, (src, offset, _at, count) in ((n, source.copy_plan(f"model.{n}")[0]) for n in ("c", "h", "s")):
        with open(src, "rb") as f:
            f.seek(offset)
            assert f.read(count) == state[name].contiguous().view(torch.uint8).numpy().tobytes(), name
    got = source.read([f"model.{n}" for n in state])
    assert all(torch.equal(got[f"model.{n}"], state[n]) for n in state)


@pytest.mark.slow
def test_uneven_shards_over_three_ranks_are_copied_raw(tmp_path):
    """Rows that do not divide by the rank count (a 1001-token vocabulary over 3 ranks: 334/334/333): every chunk
    is still a raw copy, and the merged folder equals what torch reads from the checkpoint (verify)."""
    from bench.synthetic import make_checkpoint
    from fsdp_recipes.ckpt.merge import merge_checkpoint

    ckpt = make_checkpoint(tmp_path / "run", 1, ranks=3, hidden=256, vocab=1001)
    source = DCPSource(ckpt / "pytorch_model_fsdp_0")
    assert source.tensors["model.lm_head.weight"].shape == (1001, 256)
    assert sorted(count for *_, count in source.copy_plan("model.lm_head.weight")) == [
        333 * 256 * 4,
        334 * 256 * 4,
        334 * 256 * 4,
    ]
    assert all(source.copy_plan(n) is not None for n in source.tensors)
    merge_checkpoint(ckpt, tmp_path / "out", verify=True, log=lambda *_: None)


@pytest.mark.parametrize("crc", [True, False])
def test_records_saved_without_zip_crc_are_read_as_torch_reads_them(tmp_path, crc):
    """torch.save under set_crc32_options(False) (our checkpoint shards; anyone's DCP save) stores a CRC-32 of zero,
    which torch.load never checks and Python's ZipFile.read refuses: such records are still vetted, copied raw and
    read back exactly, tensor records and byte records alike, for every dtype and a spread of shapes."""
    from fsdp_recipes.ckpt.dcp_check import vet_records

    gen = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)
    state = {
        f"w{i}": torch.randn(shape, generator=gen).to(dtype)
        for i, (shape, dtype) in enumerate((s, d) for s in ((7,), (3, 5), (64, 33), (1, 1, 9)) for d in dtypes)
    }
    extras = {"step": 17, "lr": 3e-4, "names": ["a", "b"]}
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": state, "extra": extras}, checkpoint_id=str(tmp_path), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(before)
    layout = read_layout(tmp_path)
    record = next(s for (key, _), s in layout.storage.items() if key == "model.w0")
    with open(tmp_path / record.relative_path, "rb") as f:
        archive = zipfile.ZipFile(FileSlice(f, record.offset, record.length))
        pkl = next(z for z in archive.infolist() if z.filename.endswith("data.pkl"))
        if crc:
            archive.read(pkl)
        # the case this test is for: Python's zip reader refuses the record torch reads
        else:
            with pytest.raises(Exception, match="CRC"):
                archive.read(pkl)
    assert vet_records(tmp_path, layout) == []
    source = DCPSource(tmp_path)
    # the raw copy, not torch's slow path
    assert all(source.copy_plan(f"model.{n}") is not None for n in state)
    for name, tensor in state.items():
        [(src, offset, _, count)] = source.copy_plan(f"model.{name}")
        with open(src, "rb") as f:
            f.seek(offset)
            assert f.read(count) == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
    loaded = {"model": {n: torch.empty_like(t) for n, t in state.items()}, "extra": dict.fromkeys(extras)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # torch's reader, through our guard where installed
        dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(loaded["model"][n], t) for n, t in state.items()) and loaded["extra"] == extras


def _record(tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _raw_copy_or_none(tmp_path, data: bytes):
    """What the converter would copy for a record holding ``data``: the bytes raw_tensor points at, or None."""
    from fsdp_recipes.ckpt.dcp_layout import Stored

    path = tmp_path / "__0_0.distcp"
    # other records before and after it, as in a .distcp file
    path.write_bytes(b"\x00" * 37 + data + b"\xff" * 64)
    raw = raw_tensor(tmp_path, Stored(path.name, 37, len(data), False))
    if raw is None:
        return None
    assert raw.data_offset >= 37 and raw.data_offset + raw.nbytes <= 37 + len(data), (
        "the copy reaches outside its record"
    )
    return path.read_bytes()[raw.data_offset : raw.data_offset + raw.nbytes]


def _torch_bytes(data: bytes):
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 (torch refuses the record)
        return None
    return (
        t.resolve_neg().resolve_conj().contiguous().view(torch.uint8).numpy().tobytes()
        if isinstance(t, torch.Tensor)
        else None
    )


def _hostile_variants(data: bytes) -> dict[str, bytes]:
    """Records crafted so that Python's zip reader and torch's could disagree (each could make the converter copy
    bytes other than the tensor torch loads)."""
    import struct

    infos = {i.filename: i for i in zipfile.ZipFile(io.BytesIO(data)).infolist()}
    folder = next(iter(infos)).split("/")[0]
    out = {}
    # a second byteorder-like name
    decoy = data.replace(f"{folder}/byteorder".encode(), f"{folder}/byteordeX".encode())
    out["renamed byteorder"] = decoy
    out["storage key renamed in the pickle"] = data.replace(b"X\x01\x00\x00\x000q", b"X\x01\x00\x00\x001q", 1)
    out["data member renamed"] = data.replace(f"{folder}/data/0".encode(), f"{folder}/data/1".encode())
    out["byteorder big"] = data.replace(b"little", b"bigxxx")
    out["bytes prepended"] = b"PK\x03\x04junk" + data
    end = data.rfind(b"PK\x05\x06")
    out["second central directory"] = data[:end] + data[data.find(b"PK\x01\x02") : end] + data[end:]
    # its central directory entry: the DOS "directory" attribute
    directory = data.rfind(f"{folder}/data/0".encode())
    out["data member marked a directory"] = data[: directory - 8] + struct.pack("<I", 0x10) + data[directory - 4 :]
    info = infos[f"{folder}/data/0"]
    at = info.header_offset + 28
    out["extra field past the end"] = data[:at] + struct.pack("<H", 0xFFF0) + data[at + 2 :]
    out["cut off"] = data[: len(data) // 2]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_raw_copy_is_always_the_tensor_torch_loads(tmp_path, dtype):
    """The converter copies a record's bytes without torch only when they are the tensor torch.load returns:
    the plain record is copied raw; crafted ones (second central directory, renamed members, decoy names, a
    member past the record's end, bytes prepended) and 400 random mutations of the archive's headers are
    either that tensor's bytes or left to torch (None), and a copy never reaches outside its record."""
    import random

    tensor = (torch.arange(96).reshape(8, 12) * 3).to(dtype)
    data = _record(tensor)
    assert _raw_copy_or_none(tmp_path, data) == _torch_bytes(data) is not None
    cases = _hostile_variants(data)
    rng = random.Random(0)
    # zip structures, names, pickle (not the zero padding)
    header_bytes = [i for i in range(len(data)) if data[i]]
    for n in range(400):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.choice(header_bytes)] = rng.randrange(256)
        cases[f"mutation {n}"] = bytes(mutated)
    for name, variant in cases.items():
        copied = _raw_copy_or_none(tmp_path, variant)
        if copied is not None:
            assert copied == _torch_bytes(variant), name


def _record_with_pickle(pkl: bytes, numel: int) -> bytes:
    """A record as torch's own writer lays it out, around a hand-made data.pkl."""
    buffer = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buffer)
    for name, value in (("data.pkl", pkl), ("byteorder", b"little"), ("data/0", bytes(4 * numel))):
        writer.write_record(name, value, len(value))
    writer.write_end_of_file()
    return buffer.getvalue()


def _tensor_pickle(size: tuple, stride: tuple, tail: bytes = b"") -> bytes:
    """data.pkl of _rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict()) + ``tail`` opcodes before STOP."""

    def ints(values):
        return b"(" + b"".join(b"K" + bytes([v]) for v in values) + b"t"

    numel = 1
    for d in size:
        numel *= d
    storage = (
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK"
        + bytes([numel])
        + b"tQ"
    )
    hooks = b"ccollections\nOrderedDict\n)R"
    return (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n("
        + storage
        + b"K\x00"
        + ints(size)
        + ints(stride)
        + b"\x89"
        + hooks
        + b"tR"
        + tail
        + b"."
    )


def test_records_torch_would_read_differently_or_refuse_are_never_copied_raw(tmp_path):
    """A negated view (torch.save keeps the flag, torch.load applies it), a BUILD after the tensor (torch calls
    set_ on it), opcodes torch's restricted reader refuses, and a shape of many dimensions (which took quadratic
    time before any check): none is copied raw, and the last returns at once."""
    import time

    neg = _record(torch._neg_view(torch.arange(1.0, 7.0)))
    assert _torch_bytes(neg) is not None and _raw_copy_or_none(tmp_path, neg) is None
    plain = _record_with_pickle(_tensor_pickle((2, 3), (3, 1)), 6)
    # the hand-made record is a good one
    assert _raw_copy_or_none(tmp_path, plain) == _torch_bytes(plain) is not None
    # BUILD(None), DUP, a text PUT: a raw copy would not be torch's reading
    for tail in (b"N\x62", b"2", b"p0\n"):
        assert _raw_copy_or_none(tmp_path, _record_with_pickle(_tensor_pickle((2, 3), (3, 1), tail), 6)) is None, tail
    many = _record_with_pickle(_tensor_pickle((1,) * 20000, (1,) * 20000), 1)
    started = time.perf_counter()
    assert _raw_copy_or_none(tmp_path, many) is None
    assert time.perf_counter() - started < 1.0
