"""A local data file's first MiB, checked before any process group exists: datasets reads the whole file later,
on every rank, where a bad line would be a traceback per process instead of one line."""

from __future__ import annotations

from pathlib import Path

SAMPLE_BYTES = 1 << 20  # the part of a data file checked before anything starts: the first MiB


def train_file_problem(path: Path, args) -> str | None:
    """What makes a local data file unusable, from its first MiB (the whole file is read after the process group
    exists, by datasets, where a bad line would be a traceback on every rank): empty, not UTF-8 text, JSON lines
    that do not parse, chat messages that are not role/content turns, no assistant turn to train on. ``args``: the
    DataArguments (data_format and the column names), passed in by DataArguments itself."""
    import codecs
    import json

    if path.stat().st_size == 0:
        return "the file is empty: give a file with training examples"
    if path.suffix == ".parquet":
        return None  # binary by design; datasets checks its schema
    try:
        with open(path, "rb") as f:
            head = f.read(SAMPLE_BYTES)
    except OSError as err:
        return f"cannot be read ({err.strerror}): check its permissions"
    try:  # utf-8-sig: a byte-order mark, which editors on Windows write and datasets accepts, is not text
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(head, final=len(head) < SAMPLE_BYTES)
    except UnicodeDecodeError as err:
        return f"byte {err.start} is not UTF-8 text: is this the right file (a {path.suffix} of text is expected)?"
    if "\x00" in text:
        return "the file holds NUL bytes: it is binary, not text"
    if path.suffix == ".csv":
        return _csv_problem(text, len(head) == SAMPLE_BYTES, args)
    if path.suffix not in (".json", ".jsonl"):
        return None
    lines = text.splitlines()
    if len(head) == SAMPLE_BYTES:
        lines = lines[:-1]  # the last line may be cut
        if not lines:
            return None  # a first record longer than the sample: datasets reads it whole
    if path.suffix == ".json" and text.lstrip().startswith("["):
        if len(head) == SAMPLE_BYTES:
            return None  # one large JSON array: datasets parses it
        try:
            records = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as err:
            return f"not valid JSON ({err.msg} at line {err.lineno})"
    else:
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                return f"line {number} is not JSON ({err.msg}): one JSON object per line is expected"
    if not records:
        return "no JSON records in the file"
    for number, record in records:
        if not isinstance(record, dict):
            return f"record {number} is a {type(record).__name__}, not an object with a {args.text_column!r} or {args.messages_column!r} field"
    chat = args.data_format == "chat" or (args.data_format == "auto" and args.messages_column in records[0][1])
    if not chat:
        missing = next((n for n, r in records if args.text_column not in r), None)
        if missing is not None:
            return f"record {missing} has no {args.text_column!r} field (set text_column, or data_format)"
        wrong = next((n for n, r in records if not isinstance(r[args.text_column], str)), None)
        if wrong is not None:
            value = dict(records)[wrong][args.text_column]
            return f"record {wrong}: {args.text_column!r} is {_kind(value)}, not text: fix or drop that record"
        return None
    assistant_turns = 0
    for number, record in records:
        messages = record.get(args.messages_column)
        if not isinstance(messages, list) or not messages:
            return f"record {number}: {args.messages_column!r} is {type(messages).__name__ if messages is not None else 'missing'}, not a list of turns"
        for turn in messages:
            if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
                return f"record {number}: every turn needs a 'role' and a 'content' (got {str(turn)[:80]})"
            if not isinstance(turn["content"], str):
                return f"record {number}: a {turn['role']!r} turn's 'content' is {_kind(turn['content'])}, not text: fix or drop that record"
        assistant_turns += sum(turn["role"] == "assistant" for turn in messages)
    if not assistant_turns:
        return "no conversation has an assistant turn: the loss is computed on assistant tokens only, so there is nothing to train on"
    return None


def _kind(value) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({str(value)[:40]})"


def _csv_problem(text: str, cut: bool, args) -> str | None:
    """A CSV's header must name the text column, and no sampled row may leave it empty (datasets reads an empty
    cell as null, which the tokenizer cannot take)."""
    import csv

    rows = list(csv.reader(text.splitlines()[:-1] if cut else text.splitlines()))
    if not rows:
        return None
    header = rows[0]
    if args.data_format != "chat" and args.text_column not in header:
        return f"the CSV header ({', '.join(header)[:120]}) has no {args.text_column!r} column: set text_column"
    if args.text_column in header:
        column = header.index(args.text_column)
        for number, row in enumerate(rows[1:], 2):
            if row and (len(row) <= column or not row[column].strip()):
                return f"line {number}: the {args.text_column!r} cell is empty: fix or drop that row"
    return None
