"""Every chat record is checked as it is rendered: a bad record anywhere in the data (past the first MiB the checks
before the run read, or in a Parquet file they cannot read) is one line naming it by its number, never a traceback;
a conversation left with nothing to train on is dropped with the true reason (its assistant turn begins past
block_size, or it has none), and how many were dropped is said once, on rank 0. Cases are generated: each kind of
bad record at each position and in each format pyarrow can store it in; each mix of kept and dropped conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO
from datasets import Dataset

from fsdp_recipes.config import data_files
from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.data import IGNORE_INDEX, build_datasets, tokenize_chat

TINY = REPO / "assets" / "tiny-llama"
ASSISTANT = {"role": "assistant", "content": "Ada has 4 cats."}
# a long user turn, so that few records fill the checked sample (each is rendered, and rendering is the slow part)
GOOD = {"messages": [{"role": "user", "content": "How many cats? " * 700}, ASSISTANT]}
TURNS = [{"role": "user", "content": "hi"}, ASSISTANT]

# kind -> (the bad record, the formats it can be stored in, what its line must say)
BAD = {
    "prompt_completion_record": ({"prompt": "2 + 2?", "completion": "4"}, ("jsonl", "parquet"), "prompt/completion"),
    "text_record": ({"text": "plain text"}, ("jsonl", "parquet"), "'messages' is missing or null"),
    "null_messages": ({"messages": None}, ("jsonl", "parquet"), "'messages' is missing or null"),
    "empty_message_list": ({"messages": []}, ("jsonl", "parquet"), "'messages' is an empty list"),
    "null_content": (
        {"messages": [{"role": "user", "content": None}, ASSISTANT]},
        ("jsonl", "parquet"),
        "a 'user' turn's 'content' is null, not text",
    ),
    "null_role": (
        {"messages": [{"role": None, "content": "hi"}, ASSISTANT]},
        ("jsonl", "parquet"),
        "every turn needs a 'role' and a 'content'",
    ),
    "messages_as_a_string": ({"messages": "hello"}, ("jsonl",), "'messages' is str, not a list of turns"),
    "messages_as_json_text": ({"messages": json.dumps(TURNS)}, ("jsonl",), "store the list itself"),
    "messages_as_an_object": ({"messages": {"role": "user"}}, ("jsonl",), "'messages' is a dict"),
    "turn_that_is_text": ({"messages": ["hi", "there"]}, ("jsonl",), "every turn needs a 'role' and a 'content'"),
    "turn_without_role": (
        {"messages": [{"content": "hi"}, ASSISTANT]},
        ("jsonl",),
        "every turn needs a 'role' and a 'content'",
    ),
    "number_content": (
        {"messages": [{"role": "user", "content": 3}, ASSISTANT]},
        ("jsonl",),
        "a 'user' turn's 'content' is a int (3), not text",
    ),
}
CASES = [(kind, fmt, late) for kind, (_, formats, _) in BAD.items() for fmt in formats for late in (False, True)]
# JSON text among lists is a column of datasets' Json type, which decodes it into the list: that record trains
CASES.remove(("messages_as_json_text", "jsonl", True))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


# The checks before the run read a file's first MiB; here its first 64 KiB, so that a record past them is reached by
# rendering 16 times fewer records (rendering is the slow part)
TEST_SAMPLE_BYTES = 64 << 10


@pytest.fixture(autouse=True)
def test_sample(monkeypatch):
    monkeypatch.setattr(data_files, "SAMPLE_BYTES", TEST_SAMPLE_BYTES)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A datasets cache of the test's own: a cached load of an earlier file of the same name must not hide the fault."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write(path: Path, records: list[dict]) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # every record's fields, null where it has none
        columns = dict.fromkeys(k for r in records for k in r)
        pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in records] for k in columns}), path)


def data_with(path: Path, bad: dict, late: bool) -> int:
    """Good records with ``bad`` among them, before or past the checked sample; returns the bad record's number."""
    before = data_files.SAMPLE_BYTES // len(json.dumps(GOOD)) + 3 if late else 2
    write(path, [GOOD] * before + [bad] + [GOOD] * 2)
    if late and path.suffix == ".jsonl":
        assert path.stat().st_size - 3 * len(json.dumps(GOOD)) > data_files.SAMPLE_BYTES
    return before + 1


@pytest.mark.parametrize(
    "kind, fmt, late", CASES, ids=[f"{k}-{f}-{'late' if late else 'early'}" for k, f, late in CASES]
)
def test_a_bad_chat_record_anywhere_is_one_line_naming_it(tmp_path, tokenizer, kind, fmt, late):
    bad, _, expected = BAD[kind]
    path = tmp_path / f"chat.{fmt}"
    number = data_with(path, bad, late)
    # before the run (DataArguments' checks) or as the data is rendered
    with pytest.raises(RecipeError) as err:
        build_datasets(DataArguments(train_file=str(path), block_size=32), tokenizer)
    message = str(err.value)
    assert "\n" not in message and len(message) < 600 and expected in message, message
    assert f"record {number}" in message, message


def test_a_record_of_shuffled_data_is_named_by_its_text(tokenizer):
    """A mixture or a held-out share is shuffled: no record number is given then, the record's first characters are."""
    raw = Dataset.from_list([GOOD, {"messages": [{"role": "user", "content": None}, ASSISTANT]}])
    with pytest.raises(RecipeError, match=r"^a record \(\{'messages': \[\{'role': 'user', 'content': None"):
        tokenize_chat(raw, tokenizer, DataArguments(train_file=str(REPO / "assets/data/tiny_chat.jsonl")))


def conversation(prompt_words: int, assistant: bool = True) -> dict:
    turns = [{"role": "user", "content": "cat " * prompt_words}]
    return {"messages": turns + ([ASSISTANT] if assistant else [])}


# (conversations kept, whose assistant turn begins past block_size, with no assistant turn)
MIXES = [(5, 5, 0), (1, 9, 0), (9, 1, 0), (4, 3, 3), (8, 0, 2), (0, 10, 0), (0, 6, 4), (0, 0, 10)]


@pytest.mark.parametrize("kept, past, none", MIXES, ids=[f"kept{k}-past{p}-none{n}" for k, p, n in MIXES])
def test_conversations_dropped_from_the_loss_are_counted_with_the_reason(tokenizer, capsys, kept, past, none):
    block = 32
    rows = [conversation(2)] * kept + [conversation(60)] * past + [conversation(2, assistant=False)] * none
    args = DataArguments(train_file=str(REPO / "assets/data/tiny_chat.jsonl"), block_size=block)
    if not kept:
        with pytest.raises(RecipeError) as err:
            tokenize_chat(Dataset.from_list(rows), tokenizer, args)
        message = str(err.value)
        assert "shorter than block_size" not in message and f"of {len(rows)}," in message, message
    else:
        dataset = tokenize_chat(Dataset.from_list(rows), tokenizer, args)
        assert len(dataset) == kept and all(any(t != IGNORE_INDEX for t in r) for r in dataset["labels"])
        message = capsys.readouterr().err
        if past + none == 0:
            assert "dropped" not in message
            return
        assert message.count("dropped") == 1, message
        assert f"{past + none} of {len(rows)} training conversations are dropped" in message, message
    assert (f"{past} begin their assistant turns past block_size={block}" in message) == bool(past), message
    assert (f"{none} have no assistant tokens" in message) == bool(none), message


def test_the_drop_count_is_said_once_and_on_rank_0_only(tokenizer, capsys, monkeypatch):
    args = DataArguments(train_file=str(REPO / "assets/data/tiny_chat.jsonl"), block_size=32)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        dataset = tokenize_chat(Dataset.from_list([conversation(2), conversation(60)]), tokenizer, args)
        said = capsys.readouterr().err
        assert len(dataset) == 1 and said.count("1 of 2 training conversations are dropped") == (rank == "0"), said


def test_a_bad_record_is_named_by_its_number_in_the_file_with_several_workers(tokenizer):
    """preprocessing_num_workers splits the rows among processes: the number is still the record's in the file."""
    rows = [conversation(2)] * 30 + [{"messages": []}] + [conversation(2)] * 30
    args = DataArguments(train_file=str(REPO / "assets/data/tiny_chat.jsonl"), preprocessing_num_workers=2)
    with pytest.raises(RecipeError, match="^train_file='x.jsonl' record 31: 'messages' is an empty list"):
        tokenize_chat(Dataset.from_list(rows), tokenizer, args, "train_file='x.jsonl'")
