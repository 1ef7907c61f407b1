"""Data that used to end in a traceback on every rank, or a hang, is one line naming the file, what is wrong and the
fix: a fault anywhere in a local data file (before the first MiB the checks before the run see it, past it the
loader meets it: either way one RecipeError, with the file's own line number where it can be found), a chat template
that never finishes or raises, a train_file that is not a regular file, and data in formats this recipe does not
read (TRL's prompt/completion, ShareGPT). The cases are generated: each fault in each text format, before and after
the first MiB, through parse_args and build_datasets as train_fsdp.py calls them; no launches."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, make_special

from fsdp_recipes.config import data_files
from fsdp_recipes.config.data_files import train_file_problem
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train import data

NO_FSDP = ("--allow_no_fsdp", "true")
TINY = REPO / "assets" / "tiny-llama"
# The checks before the run read a file's first MiB; here its first 64 KiB, so that past them is 16 times fewer
# records to write and load
TEST_SAMPLE_BYTES = 64 << 10
# lines of good_lines past the sample and its 10 KB margin
LATE_LINES = 4_000
# a reader or render that regressed to hanging fails its case instead of the suite
GUARD_SECONDS = 20


@pytest.fixture(autouse=True)
def test_sample(monkeypatch):
    monkeypatch.setattr(data_files, "SAMPLE_BYTES", TEST_SAMPLE_BYTES)


@pytest.fixture(autouse=True)
def guard(tmp_path, monkeypatch):
    """An alarm that turns a hang into a failure, and a datasets cache of the test's own (a cached load of an earlier
    file of the same name must not hide the fault)."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))

    def hung(signum, frame):
        raise TimeoutError(f"hung for {GUARD_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, GUARD_SECONDS)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def build(tmp_path: Path, tokenizer, *flags: str):
    """parse_args then build_datasets, as train_fsdp.py runs them: the first RecipeError either raises."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"config_name: {TINY}\nblock_size: 16\n")
    _, data_args, _ = parse_args([str(recipe), *flags, *NO_FSDP])
    return data.build_datasets(data_args, tokenizer)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and len(message) < 600, message
    return message


# ----- 1. a fault anywhere in a data file -----


def good_lines(suffix: str, n: int) -> list[bytes]:
    if suffix in (".jsonl", ".json"):
        return [json.dumps({"text": f"hello world, document number {i}"}).encode() for i in range(n)]
    if suffix == ".csv":
        return [b"text,label"] + [f"hello world document {i},{i % 2}".encode() for i in range(n - 1)]
    return [f"hello world, plain text document {i}".encode() for i in range(n)]


# fault -> (its line, the formats it applies to, what the error must say besides the file)
FAULTS = {
    "not_utf8": ("caf\xe9 au lait".encode("latin-1"), (".txt", ".jsonl", ".csv"), "is not UTF-8 text"),
    "broken_json": (b'{"text": broken', (".jsonl", ".json"), "is not JSON"),
    "unterminated_json": (b'{"text": "no closing quote', (".jsonl", ".json"), "is not JSON"),
    "json_list_line": (b"[1, 2]", (".jsonl",), "is a list"),
    "csv_extra_fields": (b"a,b,c,d", (".csv",), "Expected 2 fields"),
    "csv_open_quote": (b'"never closed,1', (".csv",), "EOF inside string"),
}
CASES = [
    (fault, suffix, late) for fault, (_, suffixes, _) in FAULTS.items() for suffix in suffixes for late in (False, True)
]


def write_with_fault(path: Path, fault: str, late: bool) -> int:
    """A file of good records with the fault's line before or after the first MiB; returns that line's number.
    JSON-looking faults inside a not_utf8 line are kept JSON, so that only the encoding is wrong."""
    bad, _, _ = FAULTS[fault]
    if fault == "not_utf8" and path.suffix == ".jsonl":
        bad = b'{"text": "' + bad + b'"}'
    if fault == "not_utf8" and path.suffix == ".csv":
        bad = bad + b",1"
    lines = good_lines(path.suffix, LATE_LINES if late else 5)
    if late:
        assert sum(len(line) + 1 for line in lines) > data_files.SAMPLE_BYTES + 10_000
    lines = [*lines, bad, *good_lines(path.suffix, 4)[1 if path.suffix == ".csv" else 0 :]]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return len(lines) - (3 if path.suffix == ".csv" else 4)


@pytest.mark.parametrize(
    "fault, suffix, late", CASES, ids=[f"{f}-{s[1:]}-{'late' if late else 'early'}" for f, s, late in CASES]
)
def test_a_fault_anywhere_in_the_file_is_one_line(tmp_path, tokenizer, fault, suffix, late):
    path = tmp_path / f"data{suffix}"
    line = write_with_fault(path, fault, late)
    with pytest.raises(RecipeError) as err:
        build(tmp_path, tokenizer, "--train_file", str(path))
    message = one_line_error(err)
    assert f"train_file={str(path)!r}" in message and FAULTS[fault][2] in message, message
    # pandas counts the file's lines itself
    if fault not in ("csv_extra_fields", "csv_open_quote"):
        # a JSON line's record number is its line's
        assert re.search(rf"\b(line|record) {line}\b", message), message


# Characters str.splitlines ends a line at and JSON and CSV do not (json.dumps(ensure_ascii=False) writes them raw)
SPLITLINES_ENDS = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
@pytest.mark.parametrize("char", SPLITLINES_ENDS, ids=[f"U+{ord(c):04X}" for c in SPLITLINES_ENDS])
def test_a_record_holding_a_character_only_str_splitlines_ends_lines_at_loads(tmp_path, tokenizer, char, suffix):
    """They were cut there by the checks before the run: 'line 1 is not JSON' for a file datasets loads."""
    import csv

    docs = [f"first document{char}still the first", "second document", f"third{char}"]
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([["text"], *([d] for d in docs)])
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": d} for d in docs], ensure_ascii=False), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    dataset, _, _ = build(tmp_path, tokenizer, "--train_file", str(path), "--packing", "padding_free")
    assert len(dataset) > 0


@pytest.mark.parametrize("lines_per_cell", [2, 7, 40])
def test_a_csv_over_the_sample_with_multi_line_cells_before_the_text_loads(tmp_path, tokenizer, lines_per_cell):
    """The first MiB ends inside a quoted cell of many lines, before the text column: the last row read, cut short, is
    not judged (as a row whose text cell is empty); datasets loads the file."""
    import csv

    path = tmp_path / "data.csv"
    note = "\n".join(f"note line {i} " + "x" * 40 for i in range(lines_per_cell))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notes", "text"])
        written = 0
        while written < data_files.SAMPLE_BYTES + 100_000:
            writer.writerow([note, "hello world document"])
            written += len(note) + 30
    dataset, _, _ = build(tmp_path, tokenizer, "--train_file", str(path), "--max_train_samples", "50")
    assert len(dataset) > 0


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("first_chat", [2, 5, 40])
def test_chat_records_after_text_ones_are_one_line_before_the_run(tmp_path, tokenizer, first_chat, suffix):
    """The loader takes the union of every record's keys: one record with messages makes the file chat data, and
    the records without are then conversations with none (every rank's apply_chat_template failed on None). The
    checks before the run judged the file by its first record, as text, and let it through."""
    records = [{"text": f"document {i}"} for i in range(first_chat - 1)]
    records += [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3
    path = tmp_path / f"data{suffix}"
    text = json.dumps(records) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        parse_args(["--train_file", str(path), "--output_dir", str(tmp_path / "out"), *NO_FSDP])
    assert "record 1: 'messages' is missing" in one_line_error(err)


def test_the_faulty_file_is_named_when_it_is_the_validation_file(tmp_path, tokenizer):
    good, bad = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    good.write_bytes(b"\n".join(good_lines(".jsonl", 200)) + b"\n")
    line = write_with_fault(bad, "broken_json", late=True)
    with pytest.raises(RecipeError) as err:
        build(tmp_path, tokenizer, "--train_file", str(good), "--validation_file", str(bad))
    message = one_line_error(err)
    assert f"validation_file={str(bad)!r}" in message and f"line {line} is not JSON" in message, message


def test_a_good_file_past_the_first_mib_loads(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(good_lines(".jsonl", LATE_LINES)) + b"\n")
    dataset, _, _ = build(tmp_path, tokenizer, "--train_file", str(path), "--max_train_samples", "50")
    assert len(dataset) > 0


def parquet_bytes(tmp_path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"hello world {i}" for i in range(100)]}), tmp_path / "real.parquet")
    return (tmp_path / "real.parquet").read_bytes()


@pytest.mark.parametrize("case", ["text", "truncated", "empty_magic_only", "footer_cut"])
def test_a_file_that_is_not_parquet_is_one_line(tmp_path, tokenizer, case):
    real = parquet_bytes(tmp_path)
    contents = {
        "text": b"this is not parquet\n" * 10,
        "truncated": real[: len(real) // 2],
        "empty_magic_only": b"PAR1",
        "footer_cut": real[:-1],
    }[case]
    path = tmp_path / "data.parquet"
    path.write_bytes(contents)
    with pytest.raises(RecipeError) as err:
        build(tmp_path, tokenizer, "--train_file", str(path))
    assert f"train_file={str(path)!r}" in one_line_error(err) and "not a Parquet file" in str(err.value)


def test_the_loaders_errors_past_the_checks_are_one_line(tmp_path):
    """load_file itself, for a fault the checks before the run do not look for (a parquet file whose data pages are
    garbage behind good markers): whatever the loader raises is one line naming the file."""
    real = bytearray(parquet_bytes(tmp_path))
    real[4:-8] = b"\xff" * (len(real) - 12)
    path = tmp_path / "data.parquet"
    path.write_bytes(bytes(real))
    # the markers are there
    assert train_file_problem(path, None) is None
    with pytest.raises(RecipeError) as err:
        data.load_file(str(path), "train", "train_file")
    assert one_line_error(err).startswith(f"train_file={str(path)!r} cannot be read as parquet data (")


# ----- 2. chat templates that never finish, or raise -----

HOSTILE = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
PLAIN = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt "
    "%}<|assistant|>{% endif %}"
)
CHAT = (
    "--train_file",
    str(REPO / "assets" / "data" / "tiny_chat.jsonl"),
    "--max_train_samples",
    "20",
    "--block_size",
    "128",
)


def chat_tokenizer(template: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.chat_template = template
    return tokenizer


def test_a_chat_template_that_never_finishes_stops_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHAT_TEMPLATE_SECONDS", 0.5)
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(RecipeError) as err:
        build(tmp_path, chat_tokenizer(HOSTILE), *CHAT)
    assert time.monotonic() - start < 10
    message = one_line_error(err)
    assert "chat template" in message and str(TINY) in message and "over 0.5 s" in message, message
    # the guard's alarm and handler are back, with the guard's time less what passed
    assert signal.getsignal(signal.SIGALRM) is before and 0 < signal.getitimer(signal.ITIMER_REAL)[0] < GUARD_SECONDS


@pytest.mark.parametrize("template", ["tiny", "plain"])
def test_a_normal_template_renders_as_without_a_limit(tmp_path, monkeypatch, template):
    tokenizer = chat_tokenizer((TINY / "chat_template.jinja").read_text() if template == "tiny" else PLAIN)
    monkeypatch.setattr(data, "CHAT_TEMPLATE_SECONDS", 1e6)
    unlimited, _, _ = build(tmp_path, tokenizer, *CHAT)
    monkeypatch.setattr(data, "CHAT_TEMPLATE_SECONDS", 2.0)
    limited, _, _ = build(tmp_path, tokenizer, *CHAT)
    assert limited["labels"] == unlimited["labels"] and limited["input_ids"] == unlimited["input_ids"]
    assert len(limited) == 20


def test_the_limit_is_kept_off_other_threads():
    """signal.signal raises off the main thread: there the block runs to its end, without a limit, instead."""
    done = []

    def work():
        with data._time_limit(0.05):
            time.sleep(0.2)
            done.append(True)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert done == [True]


def test_the_limits_alarm_at_any_of_its_calls_hands_back_the_callers_timer():
    """The limit's alarm can land at any call the guard makes while a timer runs, its arming and cancelling included
    (a signal's handler runs at whichever call comes next): the block ends in the limit or not at all, and the caller's
    handler and timer are back after each."""
    code = data._time_limit.__wrapped__.__code__

    def callers(signum, frame):
        raise AssertionError("the caller's alarm, not due yet")

    # the guarded block, SIGALRM at the at-th call: (calls seen, limit hit)
    def run(at: int) -> tuple[int, bool]:
        seen = 0

        def profile(frame, event, arg):
            nonlocal seen
            caller = frame if event == "c_call" else frame.f_back
            if event in ("call", "c_call") and caller is not None and caller.f_code is code:
                # the guard's handler is in place and a timer runs (the caller's, then the guard's): an alarm can come
                if signal.getsignal(signal.SIGALRM) is not callers and signal.getitimer(signal.ITIMER_REAL)[0] > 0:
                    if seen == at:
                        os.kill(os.getpid(), signal.SIGALRM)
                    seen += 1

        sys.setprofile(profile)
        try:
            with data._time_limit(30):
                pass
            return seen, False
        except data._TimeLimit:
            return seen, True
        finally:
            sys.setprofile(None)

    before = signal.signal(signal.SIGALRM, callers)
    signal.setitimer(signal.ITIMER_REAL, 60)
    try:
        calls, hit = run(-1)
        # the arming and the cancelling
        assert calls >= 2 and not hit, calls
        for at in range(calls):
            assert run(at)[1], at
            assert signal.getsignal(signal.SIGALRM) is callers and 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 60, at
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_template_that_raises_is_one_line(tmp_path):
    tokenizer = chat_tokenizer(
        "{% if messages[0].role == 'user' %}{{ raise_exception('Conversation roles must alternate "
        "system/user') }}{% endif %}"
    )
    with pytest.raises(RecipeError) as err:
        build(tmp_path, tokenizer, *CHAT)
    assert "Conversation roles must alternate system/user" in one_line_error(err)


# ----- 3. a train_file that is not a regular file -----


def _args():
    from types import SimpleNamespace

    return SimpleNamespace(text_column="text", messages_column="messages", data_format="auto")


# ----- 4. records and cells that are not text, and files that only look odd -----

CHAT_OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_JSONL = {
    "text null": ([{"text": "a"}, {"text": None}], "record 2: 'text' is null, not text"),
    "text number": ([{"text": 5}], "record 1: 'text' is a int (5), not text"),
    "text list": ([{"text": ["a"]}], "record 1: 'text' is a list"),
    "text object": ([{"text": {"a": 1}}], "record 1: 'text' is a dict"),
    "chat content null": (
        [CHAT_OK, {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}],
        "record 2: a 'user' turn's 'content' is null, not text",
    ),
    "chat content number": (
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3.5}]}],
        "record 1: a 'assistant' turn's 'content' is a float",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_records_that_are_not_text_are_named(tmp_path, case):
    records, expected = BAD_JSONL[case]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    problem = train_file_problem(path, _args())
    assert problem and expected in problem, problem


@pytest.mark.parametrize(
    "rows, expected",
    [
        ("text,label\nhello,1\n,2\n", "line 3: the 'text' cell is empty"),
        ("text,label\nhello,1\n   ,2\n", "line 3: the 'text' cell is empty"),
        ("body,label\nhello,1\n", "has no 'text' column"),
        ("text,label\nhello,1\nworld,2\n", None),
    ],
)
def test_csv_cells(tmp_path, rows, expected):
    path = tmp_path / "d.csv"
    path.write_text(rows)
    problem = train_file_problem(path, _args())
    assert (problem is None) if expected is None else (problem and expected in problem), problem


def test_files_datasets_reads_are_accepted(tmp_path):
    """A byte-order mark and a first record longer than the sampled MiB: datasets reads both."""
    from datasets import load_dataset

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}\n{"text": "world"}\n')
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"text": "x" * (1 << 21)}) + "\n" + json.dumps({"text": "y"}) + "\n")
    for path in (bom, big):
        assert train_file_problem(path, _args()) is None, path
        # and datasets does read it
        assert len(load_dataset("json", data_files=str(path), split="train")) == 2


NOT_A_FILE = {
    "folder": "is a folder",
    "fifo": "is a FIFO",
    "link_to_dev_zero": "is a character device",
    "broken_link": "does not exist (a broken link)",
    "missing": "does not exist",
}


@pytest.mark.parametrize("kind", sorted(NOT_A_FILE))
def test_a_path_that_is_not_a_file_is_named_as_what_it_is(tmp_path, kind):
    path = tmp_path / "data.jsonl"
    make_special(path, kind)
    problem = train_file_problem(path, _args())
    assert problem and problem.startswith(NOT_A_FILE[kind]) and "\n" not in problem, problem


@pytest.mark.parametrize("kind", ["folder", "fifo", "link_to_dev_zero"])
def test_parse_args_names_a_path_that_is_not_a_file(tmp_path, tokenizer, kind):
    path = tmp_path / "data.jsonl"
    make_special(path, kind)
    with pytest.raises(RecipeError, match=NOT_A_FILE[kind]):
        build(tmp_path, tokenizer, "--train_file", str(path))


# ----- 4. data in other formats -----

PROMPT_COMPLETION = {"prompt": "What is 2 + 2?", "completion": "4"}
CONVERSATIONAL_PC = {
    "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
    "completion": [{"role": "assistant", "content": "4"}],
}
SHAREGPT = {"conversations": [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "4"}]}
ROLE_CONTENT = {"conversations": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
# case -> (record, suffix, extra flags, what the line must say)
OTHER = {
    "prompt_completion": (PROMPT_COMPLETION, ".jsonl", (), "prompt/completion"),
    "prompt_completion_chat_format": (PROMPT_COMPLETION, ".jsonl", ("--data_format", "chat"), "prompt/completion"),
    "conversational_prompt_completion": (CONVERSATIONAL_PC, ".jsonl", (), "prompt/completion"),
    "prompt_completion_csv": (PROMPT_COMPLETION, ".csv", (), "prompt/completion"),
    "prompt_completion_parquet": (PROMPT_COMPLETION, ".parquet", (), "prompt/completion"),
    "sharegpt": (SHAREGPT, ".jsonl", (), "ShareGPT"),
    "sharegpt_chat_format": (SHAREGPT, ".jsonl", ("--data_format", "chat"), "ShareGPT"),
    "sharegpt_parquet": (SHAREGPT, ".parquet", (), "ShareGPT"),
    "role_content_conversations": (ROLE_CONTENT, ".jsonl", (), "set messages_column: conversations"),
}


def write_records(path: Path, record: dict, n: int = 30) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(record) + "\n" for _ in range(n)))
    elif path.suffix == ".csv":
        path.write_text(",".join(record) + "\n" + "".join(",".join(record.values()) + "\n" for _ in range(n)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([record] * n), path)


@pytest.mark.parametrize("case", sorted(OTHER))
def test_other_formats_are_named_with_the_conversion(tmp_path, tokenizer, case):
    record, suffix, flags, expected = OTHER[case]
    path = tmp_path / f"data{suffix}"
    write_records(path, record)
    with pytest.raises(RecipeError) as err:
        build(tmp_path, tokenizer, "--train_file", str(path), *flags)
    message = one_line_error(err)
    assert expected in message and "no 'text' field" not in message, message


def test_the_advice_for_role_content_conversations_works(tmp_path):
    path = tmp_path / "data.jsonl"
    write_records(path, ROLE_CONTENT)
    dataset, _, _ = build(
        tmp_path,
        chat_tokenizer((TINY / "chat_template.jinja").read_text()),
        "--train_file",
        str(path),
        "--messages_column",
        "conversations",
    )
    assert len(dataset) == 30
