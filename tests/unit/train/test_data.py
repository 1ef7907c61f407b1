"""Data preparation: packed text blocks and chat examples with loss on assistant tokens only."""

from __future__ import annotations

import pytest
from conftest import REPO
from datasets import Dataset
from transformers import AutoTokenizer

from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.data import IGNORE_INDEX, build_datasets, pack_text, resolve_format, tokenize_chat

CORPUS = str(REPO / "assets" / "data" / "tiny_corpus.txt")
CHAT = str(REPO / "assets" / "data" / "tiny_chat.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")


def test_packing_concatenates_documents_with_eos_into_full_blocks(tokenizer):
    docs = ["Ada sees the red cat.", "The owl walks slowly to the barn with Ben.", "Cleo has 3 cats."] * 5
    args = DataArguments(train_file=CORPUS, block_size=16)
    packed = pack_text(Dataset.from_dict({"text": docs}), tokenizer, args)
    stream = [t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    assert len(packed) == len(stream) // 16
    assert [t for row in packed["input_ids"] for t in row] == stream[: len(packed) * 16]
    assert packed["labels"] == packed["input_ids"]
    assert all(len(row) == 16 for row in packed["input_ids"])


def test_chat_labels_only_assistant_tokens(tokenizer):
    messages = [{"role": "user", "content": "How many cats?"}, {"role": "assistant", "content": "Ada has 4 cats."}]
    args = DataArguments(train_file=CHAT, block_size=64)
    row = tokenize_chat(Dataset.from_dict({"messages": [messages]}), tokenizer, args)[0]
    trained = [t for t in row["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "Ada has 4 cats.<|end|>"
    # the user turn is not trained on
    assert len(trained) < len(row["input_ids"])
    kept = [i for i, t in zip(row["input_ids"], row["labels"]) if t != IGNORE_INDEX]
    assert kept == trained


def test_format_auto_detects_chat_and_local_jsonl_loads(tokenizer):
    args = DataArguments(train_file=CHAT, block_size=64, max_train_samples=10)
    dataset, _, collator = build_datasets(args, tokenizer)
    assert len(dataset) == 10
    batch = collator([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == batch["labels"].shape
    assert (batch["labels"] == IGNORE_INDEX).any() and (batch["labels"] != IGNORE_INDEX).any()


@pytest.mark.parametrize("ext", ["csv", "parquet", "json"])
def test_local_tabular_text_files(tokenizer, tmp_path, ext):
    texts = list(open(CORPUS).read().splitlines()[:50])
    path = tmp_path / f"train.{ext}"
    frame = Dataset.from_dict({"text": texts})
    {"csv": frame.to_csv, "parquet": frame.to_parquet, "json": frame.to_json}[ext](str(path))
    dataset, _, _ = build_datasets(DataArguments(train_file=str(path), block_size=32), tokenizer)
    assert len(dataset) > 10 and len(dataset[0]["input_ids"]) == 32


def test_missing_column_is_a_clear_error():
    with pytest.raises(RecipeError, match="column 'body' not in the dataset"):
        resolve_format(DataArguments(train_file=CORPUS, text_column="body"), ["text"])


def test_templates_without_generation_blocks_locate_assistant_turns(tokenizer):
    """Most hub chat templates have no {% generation %} markers: the prefix-rendering path must find the same tokens."""
    plain = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    messages = [
        {"role": "user", "content": "How many cats?"},
        {"role": "assistant", "content": "Ada has 4 cats."},
        {"role": "user", "content": "And dogs?"},
        {"role": "assistant", "content": "Two dogs."},
    ]
    args = DataArguments(train_file=CHAT, block_size=128)
    marked = tokenize_chat(Dataset.from_dict({"messages": [messages]}), tokenizer, args)[0]
    derived = tokenize_chat(Dataset.from_dict({"messages": [messages]}), plain, args)[0]
    assert derived["input_ids"] == marked["input_ids"]
    # the prefix path also trains on the role header the template emits after the prompt, which is nothing here
    assert derived["labels"] == marked["labels"]
    assert (
        tokenizer.decode([t for t in derived["labels"] if t != IGNORE_INDEX])
        == "Ada has 4 cats.<|end|>Two dogs.<|end|>"
    )


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", b"", "the file is empty"),
        ("garbage.jsonl", bytes(range(128, 256)) * 8, "is not UTF-8 text"),
        ("nul.txt", b"text\x00\x01\x02", "holds NUL bytes"),
        ("broken.jsonl", b'{"text": "a"}\n{"text": \n', "line 2 is not JSON"),
        ("no-role.jsonl", b'{"messages": [{"content": "hi"}]}\n', "every turn needs a 'role' and a 'content'"),
        ("string.jsonl", b'{"messages": "hello"}\n', "'messages' is str, not a list of turns"),
        (
            "no-assistant.jsonl",
            b'{"messages": [{"role": "user", "content": "hi"}]}\n',
            "no conversation has an assistant turn",
        ),
        ("no-text.jsonl", b'{"body": "hi"}\n', "record 1 has no 'text' field"),
    ],
)
def test_bad_data_files_are_one_line_errors_before_anything_starts(tmp_path, name, content, message):
    """Checked from the file's first MiB while arguments are parsed, before the process group: one line each."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(RecipeError) as err:
        DataArguments(train_file=str(path))
    assert message in str(err.value) and "\n" not in str(err.value), err.value


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    from fsdp_recipes.ckpt.resume import check_output_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(RecipeError, match="is a file: choose a folder"):
        check_output_dir(str(tmp_path / "file"), resuming=False, overwrite=False)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_free_batch_gives_each_document_its_own_logits(tokenizer, attention, tmp_path):
    """packing: padding_free. Documents of different lengths in one flattened row (the collator's position_ids
    restart per document) get the same logits as each document run alone: no token attends across a boundary.
    With concat packing the second document's logits change (it attends to the first), so the test can fail."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    docs = ["Ada sees the red cat.", "The owl walks slowly to the barn with Ben and the old dog.", "Cleo has 3 cats."]
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(docs) + "\n")
    dataset, _, collator = build_datasets(
        DataArguments(train_file=str(corpus), block_size=32, packing="padding_free"), tokenizer
    )
    assert len(dataset) == 3
    batch = collator([dataset[i] for i in range(3)])
    lengths = [len(dataset[i]["input_ids"]) for i in range(3)]
    assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    starts = [sum(lengths[:i]) for i in range(3)]
    # no label predicted across a boundary
    assert all(batch["labels"][0, s] == IGNORE_INDEX for s in starts)

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama", attn_implementation=attention)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # as the Trainer calls it
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        concatenated = model(input_ids=batch["input_ids"]).logits[0]
        for i, start in enumerate(starts):
            alone = model(input_ids=torch.tensor([dataset[i]["input_ids"]])).logits[0]
            torch.testing.assert_close(packed[start : start + lengths[i]], alone, rtol=1e-5, atol=1e-5)
        second = slice(starts[1], starts[1] + lengths[1])
        assert not torch.allclose(
            concatenated[second], model(input_ids=torch.tensor([dataset[1]["input_ids"]])).logits[0], atol=1e-3
        )


def test_a_null_past_the_sample_is_one_error_not_a_tokenizer_traceback():
    """A null text the checks before the run did not sample is one RecipeError from pack_text, not a tokenizer's."""
    from types import SimpleNamespace

    from fsdp_recipes.train.modeling import load_tokenizer

    plain = {"text_column": "text", "messages_column": "messages", "data_format": "auto"}
    tokenizer = load_tokenizer(
        SimpleNamespace(**plain, tokenizer_name=str(REPO / "assets" / "tiny-llama"), trust_remote_code=False)
    )
    raw = Dataset.from_dict({"text": ["fine", None]})
    with pytest.raises(RecipeError, match="a record's 'text' is null, not text"):
        pack_text(raw, tokenizer, SimpleNamespace(**plain, block_size=8, preprocessing_num_workers=None))
