"""The zip archive of one torch.save record (a chunk of a .distcp file), read without torch: a window on its byte
range (``FileSlice``), its members when it is laid out exactly as torch.save writes it (``torch_save_layout``), and a
member's bytes read as torch's reader reads them (``stored_member``).

Python's zipfile and torch's reader (miniz) do not read every archive alike (a second central directory, names that
differ only in case, zip64 fields): an archive both could read differently is not taken as torch.save's layout.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
from dataclasses import dataclass

# ----------------------------------------------------------------------------------------------- .distcp records


class FileSlice(io.RawIOBase):
    """A read-only window on part of a file: zipfile (and torch.load) read one record of a .distcp file through it."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


# bytes of one record's pickle (not its tensor data): DCP's are a few hundred bytes
RECORD_LIMIT = 256 << 20


_TORCH_SAVE_MEMBERS = {
    "data.pkl",
    ".format_version",
    ".storage_alignment",
    "byteorder",
    "version",
    ".data/serialization_id",
}
_END, _END64, _LOCATOR64 = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
# torch.save's record format versions up to torch 2.13's (3); a newer one goes to torch
_FILE_VERSIONS = range(1, 4)


def torch_save_layout(record, length: int) -> dict[str, zipfile.ZipInfo] | None:
    """The members of a torch.save record by name (``data.pkl``, ``data/0``, ...), when the archive is laid out as
    torch.save writes it, so that Python's zip reader and torch's (miniz) cannot see different members: one folder
    name, known member names (no NUL, no duplicate, no "directory" attribute, one zip64 field at most), stored
    uncompressed with no flag torch's reader refuses, the small text members ASCII, a record version torch 2.13
    writes, one after another from
    byte 0 (each followed by nothing or its data descriptor), then the central directory exactly where the end
    record (or its zip64 record) puts it, then the end record, then nothing. None otherwise."""
    infos = zipfile.ZipFile(record).infolist()
    record.seek(length - 22)
    end = record.read(22)
    if len(end) != 22 or end[:4] != _END or not infos:
        return None
    disk, cd_disk, disk_entries, entries, cd_size, cd_offset, comment = struct.unpack("<HHHHIIH", end[4:22])
    if disk or cd_disk or disk_entries != entries or comment:
        # torch's reader refuses multi-disk archives
        return None
    end_at = length - 22
    record.seek(max(0, length - 42))
    locator = record.read(20)
    # torch writes the zip64 end record (56 bytes) and its locator before the end record
    if locator[:4] == _LOCATOR64:
        end_at = struct.unpack("<Q", locator[8:16])[0]
        record.seek(end_at)
        end64 = record.read(56)
        size, _, _, disk, cd_disk, disk_entries = struct.unpack("<QHHIIQ", end64[4:32])
        if (
            len(end64) != 56
            or end64[:4] != _END64
            or end_at + 56 != length - 42
            or size != 44
            or disk
            or cd_disk
            or struct.unpack("<I", locator[4:8])[0]
            or struct.unpack("<I", locator[16:20])[0] != 1
        ):
            return None
        numbers = struct.unpack("<QQQ", end64[32:56])
        if disk_entries != numbers[0]:
            return None
        if any(
            short not in (full, saturated)
            for short, full, saturated in zip((entries, cd_size, cd_offset), numbers, (0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF))
        ):
            # the two end records disagree: readers may differ on which they believe
            return None
        entries, cd_size, cd_offset = numbers
    if entries != len(infos) or cd_offset + cd_size != end_at:
        return None
    record.seek(cd_offset)
    directory, at = record.read(cd_size), 0
    # the directory walked by its own lengths, as miniz walks it, names the members zipfile found
    for info in infos:
        if directory[at : at + 4] != b"PK\x01\x02" or len(directory) < at + 46:
            return None
        name_len, extra_len, comment_len, disk_start, _, external = struct.unpack(
            "<HHHHHI", directory[at + 28 : at + 42]
        )
        name = directory[at + 46 : at + 46 + name_len]
        if (
            name != _raw_name(info)
            or b"\0" in name
            or disk_start
            or external & 0x10
            or not _one_zip64_field(directory[at + 46 + name_len : at + 46 + name_len + extra_len])
        ):
            # a "directory" member torch extracts nothing from, another disk, readers picking other zip64
            # fields
            return None
        at += 46 + name_len + extra_len + comment_len
    if at != cd_size:
        return None
    folder = infos[0].filename.split("/", 1)[0]
    members, position = {}, 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        name = info.filename.removeprefix(folder + "/")
        if (
            info.filename == name
            or name in members
            or info.compress_type != zipfile.ZIP_STORED
            or info.flag_bits & ~0x808
            or info.compress_size != info.file_size
            or not (name in _TORCH_SAVE_MEMBERS or re.fullmatch(r"data/\d+", name))
            or info.header_offset != position
        ):
            return None
        members[name] = info
        position = member_start(record, info) + info.file_size
        # a data descriptor follows: signature, CRC, sizes (4 or 8 bytes each)
        if info.flag_bits & 0x8:
            record.seek(position)
            descriptor = record.read(4)
            position += (16 if not info.file_size >> 32 else 24) if descriptor == b"PK\x07\x08" else 0
    if position != cd_offset:
        return None
    texts = {
        name: stored_member(record, info, 64)
        for name, info in members.items()
        if name != "data.pkl" and not name.startswith("data/")
    }
    numbers = [texts[n] for n in ("version", ".format_version", ".storage_alignment") if n in texts]
    if (
        not all(t.isascii() for t in texts.values())
        or not all(t.strip().isdigit() and len(t) < 20 for t in numbers)
        or "version" not in texts
        or int(texts["version"]) not in _FILE_VERSIONS
    ):
        # torch reads these as text and numbers (its version, the serialization id) and refuses the record
        return None
    return members


def _one_zip64_field(extra: bytes) -> bool:
    """A central directory entry's extra fields, read by their own lengths to the end, hold at most one zip64 field
    (Python's zipfile reads the last, miniz the first)."""
    at, zip64 = 0, 0
    while at < len(extra):
        if at + 4 > len(extra):
            return False
        kind, size = struct.unpack("<HH", extra[at : at + 4])
        zip64 += kind == 1
        at += 4 + size
    return at == len(extra) and zip64 <= 1


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    """A member's name as its headers hold it (zipfile's ``filename`` stops at a NUL; this does not)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def member_start(stream, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start in ``stream``: after its zip local file header, name and extra field. The
    local header must name the member the central directory names (as zipfile checks)."""
    stream.seek(info.header_offset)
    local = stream.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"no local file header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    if stream.read(name_len) != _raw_name(info):
        raise ValueError(f"the local header of {info.filename!r} names another file")
    return info.header_offset + 30 + name_len + extra_len


def stored_member(stream, info: zipfile.ZipInfo, limit: int) -> bytes:
    """The bytes of an uncompressed member of a torch.save record, at most ``limit``, read as torch's own reader reads
    them: without checking the zip CRC-32. ``torch.save`` writes a CRC of zero under
    ``torch.serialization.set_crc32_options(False)`` (our checkpoint shards, fsdp_recipes.compat.async_dcp; anyone's),
    and torch.load never checks it, where Python's ``ZipFile.read`` raises "Bad CRC-32" on such a record."""
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > limit:
        raise ValueError(f"{info.filename!r}: compressed, or more than {limit} bytes")
    stream.seek(member_start(stream, info))
    data = stream.read(info.file_size)
    if len(data) != info.file_size:
        raise ValueError(f"{info.filename!r} is cut off")
    return data


# ----------------------------------------------------------------------------------------------- vetting every record


@dataclass(frozen=True)
class RawTensor:
    """A tensor record whose data is one plain little-endian byte run in the file."""

    dtype: str
    shape: tuple[int, ...]
    # in the .distcp file
    data_offset: int
    nbytes: int


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))
