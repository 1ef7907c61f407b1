"""Training data: hub or local files, as packed plain text or chat messages with assistant-only loss.

Two ways to pack (``packing``): ``concat`` joins the documents and cuts blocks of block_size tokens (every
token counts, but one may attend to the end of the previous document); ``padding_free`` keeps each document
whole with positions restarting at 0, and a batch is one row of documents that attend only within themselves:
transformers' DataCollatorWithFlattening gives position_ids, from which its attention masks (sdpa, eager, flash)
find the document boundaries.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager
from itertools import chain
from pathlib import Path

from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetsError
from jinja2.exceptions import TemplateError
from pyarrow.lib import ArrowException
from transformers import (
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    PreTrainedTokenizerBase,
    default_data_collator,
)

from fsdp_recipes.config.arguments import DATA_EXTENSIONS, DataArguments
from fsdp_recipes.config.data_files import conversation_problem, locate_fault, other_format
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError, one_line
from fsdp_recipes.train.data_mixture import load_mixture, load_split

IGNORE_INDEX = -100
# What datasets raises on a file it cannot read: its own errors (DatasetGenerationError wraps whatever the format's
# parser raised), pyarrow's, and the parsers' ValueErrors (UnicodeDecodeError, JSONDecodeError, pandas' ParserError)
# and OSErrors. Anything past the first MiB that data_files did not see lands here, on every rank.
LOADER_ERRORS = (DatasetsError, ArrowException, ValueError, OSError)
# One conversation's rendering (a few chat template renders and their tokenization): milliseconds for real data,
# seconds for a 100k-token conversation of many turns; a template that loops for hours would stall every rank.
CHAT_TEMPLATE_SECONDS = 30.0


def load_file(path: str, split: str, key: str) -> Dataset:
    """One local data file as a Dataset; what its loader cannot read is one RecipeError naming the file (``key``:
    train_file or validation_file), what is wrong, where if it can be found, and the fix."""
    try:
        dataset = load_dataset(DATA_EXTENSIONS[Path(path).suffix], data_files={split: path}, split=split)
        # pyarrow's JSON reader (and a Parquet writer) may store bytes that are not UTF-8 as text: unchecked, they
        # would raise in the middle of tokenizing; the full check reads each string once, in C++
        dataset.data.validate(full=True)
        return dataset
    except LOADER_ERRORS as err:
        raise RecipeError(f"{key}={path!r} {_loader_problem(err, Path(path))}") from err


def _loader_problem(err: BaseException, path: Path | None) -> str:
    """The loader's complaint in one line: the first cause in the chain that is not one of datasets' wrappers ("An
    error occurred while generating the dataset" says nothing), and the line at fault when ``path`` is a local file."""
    cause, seen = err, set()
    while isinstance(cause, DatasetsError) and id(cause) not in seen and (cause.__cause__ or cause.__context__):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    said = one_line((str(cause).strip().splitlines() or [""])[0])[:200]
    said = f"{type(cause).__name__}: {said}" if said else type(cause).__name__
    if path is None:
        return f"cannot be loaded ({said}): check the dataset name, config and split"
    # not pyarrow's "cannot parse"
    if isinstance(cause, OSError) and not isinstance(cause, ArrowException) and cause.errno is not None:
        return f"cannot be loaded ({said}): check that it is readable and that the datasets cache has space"
    kind = DATA_EXTENSIONS[path.suffix]
    if (fault := locate_fault(path)) is None:
        return f"cannot be read as {kind} data ({said}): is this the right file? fix it where the message points"
    where, fix = fault
    return f"cannot be read as {kind} data: {where} (the loader said {said}): {fix}"


def load_raw(args: DataArguments, seed: int = 42) -> tuple[Dataset, Dataset | None]:
    """The raw training examples and the raw evaluation examples (None without an evaluation source)."""
    # TRL's or the handbook's mixture, loaded as their scripts load it
    if args.dataset_mixture is not None:
        train, evaluation = load_mixture(args, seed)
    # one file per call, so that an error names the file it is about
    elif args.train_file is not None:
        train = load_file(args.train_file, "train", "train_file")
        evaluation = load_file(args.validation_file, "validation", "validation_file") if args.validation_file else None
    else:
        try:
            train = load_split(args.dataset_name, args.dataset_config_name, args.dataset_split)
            evaluation = None
            if args.dataset_test_split is not None:
                evaluation = load_split(args.dataset_name, args.dataset_config_name, args.dataset_test_split)
        except RecipeError:
            raise
        except LOADER_ERRORS as err:
            raise RecipeError(f"dataset_name={args.dataset_name!r} {_loader_problem(err, None)}") from err
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    # held out before tokenizing: no document is in both
    if args.validation_split_percentage is not None:
        split = train.train_test_split(test_size=args.validation_split_percentage / 100, seed=seed)
        train, evaluation = split["train"], split["test"]
    return train, evaluation


def resolve_format(args: DataArguments, columns: list[str]) -> str:
    fmt = args.data_format
    if fmt == "auto":
        fmt = "chat" if args.messages_column in columns else "text"
    needed = args.messages_column if fmt == "chat" else args.text_column
    if needed not in columns and (other := other_format(dict.fromkeys(columns), args)):
        raise RecipeError(f"the data {other}")
    if needed not in columns:
        raise RecipeError(f"data_format={fmt}: column {needed!r} not in the dataset (columns: {', '.join(columns)})")
    # a TRL setting that means nothing for this kind of data
    if problem := args.format_problem(fmt):
        raise RecipeError(problem)
    return fmt


def texts(batch: dict, column: str) -> list[str]:
    """The batch's documents, each checked to be text: a null or a number (an empty CSV cell, a bad record past
    the part of the file checked before the run) is one line naming it, not a tokenizer traceback on every rank."""
    for value in batch[column]:
        if not isinstance(value, str):
            raise RecipeError(
                f"a record's {column!r} is "
                f"{'null' if value is None else type(value).__name__ + ' ' + str(value)[:40]}, "
                "not text: fix or drop that record in the data"
            )
    return batch[column]


def pack_text(raw: Dataset, tokenizer: PreTrainedTokenizerBase, args: DataArguments) -> Dataset:
    """Tokenize, append EOS to each document, concatenate, and cut into blocks of block_size."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        return {
            "input_ids": [
                ids + eos for ids in tokenizer(texts(batch, args.text_column), add_special_tokens=False)["input_ids"]
            ]
        }

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        usable = len(ids) // args.block_size * args.block_size
        blocks = [ids[i : i + args.block_size] for i in range(0, usable, args.block_size)]
        return {
            "input_ids": blocks,
            "labels": [list(b) for b in blocks],
            "attention_mask": [[1] * len(b) for b in blocks],
        }

    tokenized = raw.map(
        tokenize,
        batched=True,
        remove_columns=raw.column_names,
        num_proc=args.preprocessing_num_workers,
        desc="Tokenizing",
    )
    return tokenized.map(
        group,
        batched=True,
        batch_size=1000,
        num_proc=args.preprocessing_num_workers,
        desc=f"Packing into {args.block_size}-token blocks",
    )


def split_documents(raw: Dataset, tokenizer: PreTrainedTokenizerBase, args: DataArguments) -> Dataset:
    """Each document with EOS, as examples of at most block_size tokens (a longer one is split): for padding-free
    batches, where every example keeps positions of its own. TRL's packing with its bfd strategy truncates a longer
    one instead, and so does one document per row (TRL's packing false)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    truncate = args.trl_packing is False or (args.trl_packing and args.packing_strategy in (None, "bfd"))

    def tokenize(batch):
        pieces = []
        for ids in tokenizer(texts(batch, args.text_column), add_special_tokens=False)["input_ids"]:
            ids = ids + eos
            pieces += [
                ids[i : i + args.block_size]
                for i in range(0, args.block_size if truncate else len(ids), args.block_size)
            ]
        # one token predicts nothing
        pieces = [p for p in pieces if len(p) > 1]
        return {"input_ids": pieces, "labels": [list(p) for p in pieces]}

    return raw.map(
        tokenize,
        batched=True,
        remove_columns=raw.column_names,
        num_proc=args.preprocessing_num_workers,
        desc="Tokenizing documents",
    )


def assistant_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], template_kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 mask of the assistant tokens. ``template_kwargs``: the
    record's chat_template_kwargs (TRL's column, e.g. enable_thinking), passed to the template.

    Templates with ``{% generation %}`` blocks mark assistant tokens themselves. Most hub templates (Llama 3,
    Qwen, Mistral) have none: there each assistant turn is located by rendering the conversation up to the
    turn's prompt and up to its end, and the tokens between the two are the assistant's.
    """

    # Arrow fills absent keys
    extra = {k: v for k, v in (template_kwargs or {}).items() if v is not None}

    def render(msgs, **kw):
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw, **extra)["input_ids"])

    if "{% generation %}" in (tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **extra
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    ids = render(messages)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], add_generation_prompt=True)), len(render(messages[: i + 1]))
        if ids[:end] != render(messages[: i + 1]):
            raise RecipeError(
                "the chat template renders a conversation's prefix differently from the whole; cannot locate "
                "assistant tokens"
            )
        mask[start:end] = [1] * (end - start)
    return ids, mask


class _TimeLimit(BaseException):
    """Raised by the alarm inside a render: a BaseException, so that no ``except Exception`` in jinja or transformers
    takes it for an error of the template's and carries on."""


@contextmanager
def _time_limit(seconds: float):
    """Raise _TimeLimit in the block after ``seconds`` (rendering is pure Python, so the alarm's handler runs within
    it). SIGALRM reaches only the main thread: elsewhere the block runs without a limit. A timer already set by the
    caller is kept: if it is due first it is left alone, else it is set again after the block with its time left."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise _TimeLimit

    pending, interval = signal.getitimer(signal.ITIMER_REAL)
    if pending and pending <= seconds:
        yield
        return
    previous, start = signal.getsignal(signal.SIGALRM), time.monotonic()
    try:
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        # The alarm's handler runs at whichever call comes next, so it can raise at the arming (a limit shorter than
        # the call) or at the cancelling; the caller's handler and timer are put back all the same (the one-shot
        # alarm cannot come twice).
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)
            if pending:
                signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - start), 1e-3), interval)


# Why tokenize_chat drops a conversation from the loss (none of its tokens is trained on): the reason's code -> words
KEPT, PAST_BLOCK, NO_ASSISTANT = 0, 1, 2
DROPPED = {
    PAST_BLOCK: "begin their assistant turns past block_size={block} tokens (raise block_size, or shorten them)",
    NO_ASSISTANT: "have no assistant tokens (no assistant turn, or only empty ones)",
}


def tokenize_chat(
    raw: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    args: DataArguments,
    source: str | None = None,
    what: str = "training",
) -> Dataset:
    """Render messages with the chat template; labels are the assistant tokens, everything else is ignored.
    A conversation left with no label to train on is dropped, and said once (on rank 0) with how many and why;
    when none is left that is the error (``what``: training or evaluation, for those lines). A record that cannot
    be rendered is one RecipeError naming it: its number in ``source`` (the file or split it was read from, in
    that order), else its first characters."""
    if not tokenizer.chat_template:
        raise RecipeError(
            f"data_format=chat needs a chat template and tokenizer {tokenizer.name_or_path!r} has none: give the "
            "recipe's chat_template (a Jinja template) or chat_template_path (a .jinja file or a tokenizer folder)"
        )

    template = f"the chat template of tokenizer {tokenizer.name_or_path!r}"
    # TRL's default: loss on the whole conversation
    whole = getattr(args, "assistant_only_loss", None) is False
    # the handbook's maybe_insert_system_message: only where the template renders system turns
    system = getattr(args, "auto_insert_empty_system_msg", False) and any(
        mark in tokenizer.chat_template for mark in ("system", "<|im_start|>")
    )

    def render(example, index):
        label = f"{source} record {index + 1}" if source else f"a record ({str(example)[:60]})"
        if problem := conversation_problem(example, args, label):
            raise RecipeError(problem)
        messages = example[args.messages_column]
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": ""}, *messages]
        try:
            with _time_limit(CHAT_TEMPLATE_SECONDS):
                ids, mask = assistant_mask(tokenizer, messages, example.get("chat_template_kwargs"))
        except _TimeLimit:
            raise RecipeError(
                f"{template} took over {CHAT_TEMPLATE_SECONDS:g} s to render one conversation (the limit): "
                "is it the right template? fix or replace its chat_template.jinja"
            ) from None
        # the template's own raise_exception ("roles must alternate ...") or its syntax
        except TemplateError as err:
            said = one_line((str(err).strip().splitlines() or [""])[0])[:200]
            raise RecipeError(
                f"{template} fails on {label} ({type(err).__name__}: {said}): fix that record, or the template"
            ) from None
        dropped = KEPT if whole or any(mask[: args.block_size]) else PAST_BLOCK if any(mask) else NO_ASSISTANT
        ids, mask = ids[: args.block_size], mask[: args.block_size]
        labels = list(ids) if whole else [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels, "dropped": dropped}

    dataset = raw.map(
        render,
        with_indices=True,
        remove_columns=raw.column_names,
        num_proc=args.preprocessing_num_workers,
        desc="Applying chat template",
    )
    reasons = Counter(dataset["dropped"])
    reasons.pop(KEPT, None)
    if reasons:
        why = "; ".join(f"{n} {DROPPED[code].format(block=args.block_size)}" for code, n in sorted(reasons.items()))
        if sum(reasons.values()) == len(dataset):
            raise RecipeError(f"no {what} conversation has a token to train on: of {len(dataset)}, {why}")
        say(
            f"{sum(reasons.values())} of {len(dataset)} {what} conversations are dropped, with no token to train "
            f"on: {why}"
        )
    return dataset.filter(
        lambda code: code == KEPT, input_columns="dropped", desc="Dropping examples with no assistant tokens"
    ).remove_columns("dropped")


class PaddingFreeCollator(DataCollatorWithFlattening):
    """Documents flattened into one row with position_ids restarting per document, and ``use_cache=False``.

    transformers 5.23 finds the document boundaries in position_ids only when no KV cache is passed
    (masking_utils._preprocess_mask_arguments), and a model with use_cache on builds one even in training: the
    batch would then silently attend across documents. The Trainer sets the model's use_cache from
    TrainingArguments.use_cache (off by default); the flag travels with the batch so that --use_cache true, or a
    loop other than the Trainer, cannot turn packing into cross-document attention.
    """

    def __call__(self, features, *args, **kwargs):
        return {**super().__call__(features, *args, **kwargs), "use_cache": False}


def _record_source(args: DataArguments, what: str) -> str | None:
    """Where the rows of the training (or evaluation) data come from, in that order, for naming a bad record by its
    number; None where they were shuffled (a mixture, a held-out share)."""
    if args.dataset_mixture is not None or args.validation_split_percentage is not None:
        return None
    if what == "evaluation":
        if args.validation_file is not None:
            return f"validation_file={args.validation_file!r}"
        return f"dataset_name={args.dataset_name!r} split {args.dataset_test_split!r}"
    if args.train_file is not None:
        return f"train_file={args.train_file!r}"
    return f"dataset_name={args.dataset_name!r} split {args.dataset_split!r}"


def build_datasets(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int = 42
) -> tuple[Dataset, Dataset | None, object]:
    """The tokenized training set, the tokenized evaluation set (or None) and the collator that batches both."""
    raw, raw_eval = load_raw(args, seed)
    fmt = resolve_format(args, raw.column_names)
    if fmt == "chat" and args.data_format == "auto" and getattr(args, "assistant_only_loss", None) is None:
        say(
            "chat data trains on the assistant's tokens only here, where TRL's default (assistant_only_loss: false) "
            "trains on the whole conversation: set assistant_only_loss: false for that, true to say so"
        )
    if args.packing == "padding_free":
        prepare = split_documents if fmt == "text" else tokenize_chat
        collator = PaddingFreeCollator(return_position_ids=True, separator_id=IGNORE_INDEX)
    else:
        # TRL's default: one example per row, truncated, padded
        rows = fmt == "chat" or args.trl_packing is False
        prepare = tokenize_chat if fmt == "chat" else split_documents if rows else pack_text
        collator = (
            DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)
            if rows
            else default_data_collator
        )

    def prepared(data: Dataset, what: str) -> Dataset:
        if prepare is tokenize_chat:
            examples = tokenize_chat(data, tokenizer, args, _record_source(args, what), what)
        else:
            examples = prepare(data, tokenizer, args)
        if len(examples) == 0 and len(data) == 0:
            raise RecipeError(f"the {what} data has no records: give data with examples")
        if len(examples) == 0:
            why = (
                f"the {what} data is shorter than block_size={args.block_size} tokens"
                if prepare is pack_text
                else f"every {what} document is empty (one token with its EOS predicts nothing)"
            )
            raise RecipeError(f"no {what} examples after preprocessing: {why}")
        return examples

    dataset = prepared(raw, "training")
    evaluation = None
    if raw_eval is not None:
        resolve_format(args, raw_eval.column_names)
        evaluation = prepared(raw_eval, "evaluation")
    return dataset, evaluation, collator
