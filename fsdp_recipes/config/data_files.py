"""A local data file checked before any process group exists: a regular file (not a folder, a FIFO or a device),
and its first MiB; datasets reads the whole file later, on every rank, where a bad line would be a traceback per
process instead of one line. What the loader still fails on, past the first MiB, is located here (locate_fault) for
the one line train/data.py makes of it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fsdp_recipes.bounded import file_kind

# the part of a data file checked before anything starts: the first MiB
SAMPLE_BYTES = 1 << 20
# locate_fault reads a line at a time; a longer "line" is not a record it can judge (a JSON array file on one line)
LINE_LIMIT = 64 << 20
JSON_LINE_FIX = "fix or drop that line: one JSON object per line"
# at both ends of every Parquet file (PARE: an encrypted footer)
PARQUET_MAGIC = (b"PAR1", b"PARE")


class _NotAFile(Exception):
    """The path is missing or not a regular file: the message says what it is instead."""


def _head(path: Path) -> tuple[bytes, int]:
    """The file's first SAMPLE_BYTES and its size. A folder, a FIFO or a device (also behind a link: /dev/zero) is
    refused by a stat before any open, since opening a FIFO blocks until a writer comes; the open is non-blocking and
    checked again, for a file swapped in between."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        link = " (a broken link)" if os.path.islink(path) else ""
        raise _NotAFile(f"does not exist{link} (paths are relative to where you launch)") from None
    except OSError as err:
        raise _NotAFile(f"cannot be read ({err.strerror}): check its permissions") from None
    if stat.S_ISDIR(info.st_mode):
        raise _NotAFile("is a folder, not a file: give the data file itself")
    if not stat.S_ISREG(info.st_mode):
        raise _NotAFile(
            f"is {file_kind(info.st_mode)}, not a regular file: give a data file (a pipe or a device may "
            "block or never end)"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise _NotAFile(f"cannot be read ({err.strerror}): check its permissions") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _NotAFile(f"is {file_kind(info.st_mode)}, not a regular file: give a data file")
        return f.read(SAMPLE_BYTES), info.st_size


def _parquet_problem(path: Path, head: bytes, size: int) -> str | None:
    """Parquet is binary, its schema datasets' to check; but a file without Parquet's markers at both ends (text
    saved as .parquet) would be a pyarrow traceback on every rank."""
    tail = b""
    # the smallest Parquet file: both markers and the footer's length
    if size >= 12:
        with open(path, "rb") as f:
            f.seek(size - 4)
            tail = f.read(4)
    if head[:4] not in PARQUET_MAGIC or tail not in PARQUET_MAGIC:
        return (
            "is not a Parquet file (it lacks the PAR1 markers Parquet files begin and end with): is this the right "
            "file? text data goes in a .txt, .jsonl, .json or .csv"
        )
    return None


def other_format(record, args) -> str | None:
    """How to convert a record (or a list of column names, as dict keys) of a data format other than ours: TRL's
    prompt/completion and ShareGPT are common and would otherwise read as "no 'text' field"."""
    keys = set(record)
    if {"prompt", "completion"} <= keys:
        return (
            "is TRL's prompt/completion format, which this recipe does not train on: convert each record to chat "
            f"data, {{{args.messages_column!r}: [{{'role': 'user', 'content': prompt}}, {{'role': 'assistant', "
            "'content': completion}]} (conversational ones: prompt + completion as one list); the loss is then on "
            "the completion alone"
        )
    if "conversations" in keys and "conversations" != args.messages_column:
        turns = record["conversations"] if isinstance(record, dict) else None
        first = turns[0] if isinstance(turns, list) and turns else None
        sharegpt = (
            f"ShareGPT's from/value turns, which this recipe does not read: convert each record to "
            f"{{{args.messages_column!r}: [{{'role': ..., 'content': ...}}]}} (from human -> role user, gpt -> "
            "assistant, system -> system; value -> content)"
        )
        # column names alone: either kind
        if first is None:
            return (
                "has its chat under 'conversations': set messages_column: conversations if its turns are "
                f"role/content; if they are {sharegpt}"
            )
        if isinstance(first, dict) and "role" in first and "content" in first:
            return "has its chat turns under 'conversations': set messages_column: conversations"
        return f"has 'conversations' of {sharegpt}"
    return None


def locate_fault(path: Path) -> tuple[str, str] | None:
    """Where a local data file first goes wrong, found by reading it a line at a time after the loader failed:
    datasets and pyarrow count rows and bytes from the start of the block they were parsing, not of the file.
    Finds the first line that is not UTF-8 and, in JSON lines, the first that is not a JSON object: (where, the fix);
    None if no line is at fault (or a line is longer than LINE_LIMIT, or the file is one JSON array)."""
    import json
    from itertools import count

    if path.suffix == ".parquet":
        return None
    check_json = path.suffix in (".json", ".jsonl")
    offset = 0
    try:
        with open(path, "rb") as f:
            for number in count(1):
                line = f.readline(LINE_LIMIT)
                if not line:
                    return None
                if len(line) == LINE_LIMIT and not line.endswith(b"\n"):
                    # too long to judge here
                    return None
                # a newline byte is never inside a UTF-8 sequence, so each line decodes on its own
                try:
                    text = line.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    return f"line {number} (byte {offset + err.start}) is not UTF-8 text", "save the file as UTF-8"
                offset += len(line)
                if not check_json or not text.strip():
                    continue
                if number == 1 and path.suffix == ".json" and text.lstrip().startswith("["):
                    # one JSON array: the loader's position is the file's
                    check_json = False
                    continue
                try:
                    record = json.loads(text)
                except ValueError as err:
                    return f"line {number} is not JSON ({getattr(err, 'msg', str(err)[:80])})", JSON_LINE_FIX
                if not isinstance(record, dict):
                    return f"line {number} is {_kind(record)}, not a JSON object", JSON_LINE_FIX
    except OSError:
        return None
    return None


def train_file_problem(path: Path, args) -> str | None:
    """What makes a local data file unusable, from its first MiB (the whole file is read after the process group
    exists, by datasets, where a bad line would be a traceback on every rank): empty, not UTF-8 text, JSON lines
    that do not parse, chat messages that are not role/content turns, no assistant turn to train on. ``args``: the
    DataArguments (data_format and the column names), passed in by DataArguments itself."""
    import codecs

    try:
        head, size = _head(path)
    except _NotAFile as err:
        return str(err)
    if size == 0:
        return "the file is empty: give a file with training examples"
    if path.suffix == ".parquet":
        return _parquet_problem(path, head, size)
    # utf-8-sig: a byte-order mark, which editors on Windows write and datasets accepts, is not text
    try:
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(head, final=len(head) < SAMPLE_BYTES)
    except UnicodeDecodeError as err:
        line = head[: err.start].count(b"\n") + 1
        return (
            f"line {line} (byte {err.start}) is not UTF-8 text: is this the right file (a {path.suffix} of "
            "text is expected)?"
        )
    if "\x00" in text:
        return "the file holds NUL bytes: it is binary, not text"
    if path.suffix == ".csv":
        return _csv_problem(text, len(head) == SAMPLE_BYTES, args)
    if path.suffix not in (".json", ".jsonl"):
        return None
    records, problem = _json_records(text, len(head) == SAMPLE_BYTES, path.suffix)
    if problem or records is None:
        return problem
    for number, record in records:
        if not isinstance(record, dict):
            return (
                f"record {number} is a {type(record).__name__}, not an object with a {args.text_column!r} or "
                f"{args.messages_column!r} field"
            )
    # as train/data.py decides from the loaded columns: datasets' JSON loader makes the union of every record's keys
    chat = args.data_format == "chat" or (
        args.data_format == "auto" and any(args.messages_column in r for _, r in records)
    )
    if not chat:
        missing = next((n for n, r in records if args.text_column not in r), None)
        if missing is not None:
            other = other_format(dict(records)[missing], args)
            return (
                f"record {missing} {other}"
                if other
                else f"record {missing} has no {args.text_column!r} field (set text_column, or data_format)"
            )
        wrong = next((n for n, r in records if not isinstance(r[args.text_column], str)), None)
        if wrong is not None:
            value = dict(records)[wrong][args.text_column]
            return f"record {wrong}: {args.text_column!r} is {_kind(value)}, not text: fix or drop that record"
        return None
    assistant_turns = 0
    for number, record in records:
        if problem := conversation_problem(record, args, f"record {number}"):
            return problem
        assistant_turns += sum(turn["role"] == "assistant" for turn in record[args.messages_column])
    if not assistant_turns:
        return (
            "no conversation has an assistant turn: the loss is computed on assistant tokens only, so there "
            "is nothing to train on"
        )
    return None


def conversation_problem(record: dict, args, label: str) -> str | None:
    """Why one chat record cannot be rendered, as one line starting with ``label`` (where it is: "record 7" of
    the file); None when its messages are a non-empty list of role/content turns with text content. The checks
    before the run apply it to the first MiB, and train/data.py to every record it renders, so that a bad record
    anywhere is this line and not a traceback on every rank. ``record``: the record's fields (a loaded dataset's
    row holds every column of the file, null where the record has none)."""
    column = args.messages_column
    messages = record.get(column)
    if messages is None:
        given = {k: v for k, v in record.items() if v is not None}
        if other := other_format(given, args):
            return f"{label} {other}"
        fields = f" (its fields: {', '.join(sorted(given))[:80]})" if given else ""
        return (
            f"{label}: {column!r} is missing or null, not a list of turns{fields}: every record of chat data needs its "
            "turns: fix or drop that record"
        )
    if isinstance(messages, str):
        stored = " (JSON text: store the list itself, not a string of it)" if messages.lstrip()[:1] == "[" else ""
        return f"{label}: {column!r} is str, not a list of turns{stored}: fix or drop that record"
    if not isinstance(messages, list):
        return f"{label}: {column!r} is {_kind(messages)}, not a list of turns: fix or drop that record"
    if not messages:
        return f"{label}: {column!r} is an empty list: a conversation needs turns: fix or drop that record"
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            return f"{label}: every turn needs a 'role' and a 'content' (got {str(turn)[:80]})"
        if not isinstance(turn["content"], str):
            return (
                f"{label}: a {turn['role']!r} turn's 'content' is {_kind(turn['content'])}, not text: fix or drop "
                "that record"
            )
    return None


def _json_records(text: str, cut: bool, suffix: str) -> tuple[list | None, str | None]:
    """(records as (line or position, value), problem) of a JSON lines or JSON array sample; records None when the
    sample cannot be judged (a first record or an array longer than the sample: datasets reads those whole). Lines
    end at \\n only: JSON strings may hold U+2028 or U+0085 raw, which str.splitlines would cut them at."""
    import json

    lines = text.split("\n")
    if cut:
        # the last line may be cut
        lines = lines[:-1]
        if not lines:
            return None, None
    if suffix == ".json" and text.lstrip().startswith("["):
        if cut:
            return None, None
        try:
            return list(enumerate(json.loads(text), 1)), None
        except json.JSONDecodeError as err:
            return None, f"not valid JSON ({err.msg} at line {err.lineno})"
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            return None, f"line {number} is not JSON ({err.msg}): one JSON object per line is expected"
    return records, None


def sniff_format(path: Path, args) -> str | None:
    """text or chat, as train/data.py's resolve_format will decide from the loaded columns (the union of every
    record's keys), where the first MiB tells it for certain: chat once a sampled record has the messages column;
    text for a .txt, for a CSV without that column, and for JSON whose every record was sampled. None: not told
    here (Parquet, a longer file of text records, whose later records could hold messages). So a TRL setting that
    means nothing for that kind of data is refused at parse time, not after the launch has loaded the data."""
    if path.suffix == ".txt":
        return "text"
    if path.suffix not in (".json", ".jsonl", ".csv"):
        return None
    try:
        head, size = _head(path)
    except _NotAFile:
        return None
    text, cut = head.decode("utf-8-sig", errors="replace"), len(head) < size
    if path.suffix == ".csv":
        import csv
        import io

        header = next(csv.reader(io.StringIO(text)), [])
        return "chat" if args.messages_column in header else "text"
    records, _ = _json_records(text, cut, path.suffix)
    if records is None:
        return None
    if any(isinstance(r, dict) and args.messages_column in r for _, r in records):
        return "chat"
    return None if cut else "text"


def _kind(value) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({str(value)[:40]})"


def _csv_problem(text: str, cut: bool, args) -> str | None:
    """A CSV's header must name the text column, and no sampled row may leave it empty (datasets reads an empty
    cell as null, which the tokenizer cannot take)."""
    import csv
    import io

    # newline="": a quoted cell may hold line breaks, and U+2028 is no line end (str.splitlines cut rows there)
    reader = csv.reader(io.StringIO(text, newline=""))
    # (the line a row ends on, the row)
    rows = []
    try:
        for row in reader:
            rows.append((reader.line_num, row))
    # e.g. a quote never closed: the loader's error, named with its line by train/data.py
    except csv.Error:
        pass
    if cut and rows:
        # the sample ends inside the last row read, maybe inside a quoted multi-line cell: not judged
        rows.pop()
    if not rows:
        return None
    header = rows[0][1]
    if args.data_format != "chat" and args.text_column not in header:
        if other := other_format(dict.fromkeys(header), args):
            return f"the CSV {other}"
        return f"the CSV header ({', '.join(header)[:120]}) has no {args.text_column!r} column: set text_column"
    if args.text_column in header:
        column = header.index(args.text_column)
        for line, row in rows[1:]:
            if row and (len(row) <= column or not row[column].strip()):
                return f"line {line}: the {args.text_column!r} cell is empty: fix or drop that row"
    return None
