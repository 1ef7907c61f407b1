"""The data's arguments (DataArguments), as a dataclass HfArgumentParser turns into flags, and what every argument
dataclass shares: TRL's names for the same settings as extra spellings of the flags (TRL_ALIASES), the dtypes, and
``build``. The model's arguments are fsdp_recipes.config.model_arguments', the run's
fsdp_recipes.config.run_arguments', TrainingArguments is transformers'. Each checks its own fields in
``__post_init__``, before anything is loaded, with the probes of model_source and data_files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.config.data_files import sniff_format, train_file_problem
from fsdp_recipes.config.local_datasets import local_source_problem
from fsdp_recipes.config.mixture import mixture_evaluates, mixture_problem
from fsdp_recipes.config.model_source import dataset_source_problem
from fsdp_recipes.config.rules import INF, MAX_WORKERS, WORKERS_BOUND, Rule, check
from fsdp_recipes.errors import RecipeError

DATA_EXTENSIONS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}


DTYPES = ("auto", "float32", "bfloat16", "float16")


# TRL's names (SFTConfig, ScriptArguments, ModelConfig) for the same settings: extra spellings of our flags and
# recipe keys, shown in --help. Only exact equivalents; the TRL keys that mean something else are translated or
# refused in fsdp_recipes.config.trl_names.
TRL_ALIASES = {
    "max_length": "block_size",
    "max_seq_length": "block_size",
    "dataset_text_field": "text_column",
    "dataset_num_proc": "preprocessing_num_workers",
    "dataset_config": "dataset_config_name",
    "dataset_train_split": "dataset_split",
    "torch_dtype": "dtype",
}


def trl_spellings(name: str) -> list[str]:
    """The extra flags TRL_ALIASES gives our field ``name`` (block_size: --max_length, --max_seq_length)."""
    return [f"--{alias}" for alias, ours in TRL_ALIASES.items() if ours == name]


# DataArguments' evaluation data
EVAL_SOURCES = ("validation_file", "dataset_test_split", "validation_split_percentage")


@dataclass
class DataArguments:
    _argument_group_name = "data (TRL's SFTConfig names are accepted where they mean the same)"
    # rules.check, in __post_init__
    RULES = {
        "block_size": Rule(8, INF, "use at least 8 tokens"),
        "max_train_samples": Rule(1, INF, "keep at least 1 example, or leave it unset to train on all of them"),
        "preprocessing_num_workers": Rule(
            1,
            MAX_WORKERS,
            f"give 1 or more tokenizing processes ({WORKERS_BOUND}), or leave it unset to tokenize in the training "
            "process",
        ),
        "validation_split_percentage": Rule(1, 50, "hold out between 1 and 50 percent"),
    }
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id (needs hub access)."})
    dataset_mixture: str | None = field(
        default=None,
        metadata={
            "help": "A mixture of datasets, as the recipe's dataset_mixture (alignment handbook), dataset_mixer with "
            "dataset_splits (its older format) or datasets (TRL) gives it; as a flag, that mapping in JSON. "
            "fsdp_recipes/config/trl_recipe.py reads it, fsdp_recipes/train/data_mixture.py loads it."
        },
    )
    dataset_config_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset configuration name.", "aliases": trl_spellings("dataset_config_name")},
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Split to train on.", "aliases": trl_spellings("dataset_split")}
    )
    train_file: str | None = field(
        default=None,
        metadata={
            "help": f"Local training file: {', '.join(sorted(DATA_EXTENSIONS))}. Text files give one example per line."
        },
    )
    data_format: str = field(
        default="auto",
        metadata={
            "help": "text: the text column is packed into blocks of block_size tokens. chat: the messages column is "
            "rendered with the tokenizer's chat template and only assistant tokens are trained on. auto: chat if the "
            "messages column exists, else text.",
            "choices": ["auto", "text", "chat"],
        },
    )
    text_column: str = field(
        default="text", metadata={"help": "Column holding plain text.", "aliases": trl_spellings("text_column")}
    )
    messages_column: str = field(
        default="messages", metadata={"help": "Column holding chat messages (role/content dicts)."}
    )
    block_size: int = field(
        default=256,
        metadata={
            "help": "Tokens per packed block (text) or the truncation length (chat). TRL's max_length; TRL's null (no "
            "truncation) has no equivalent here.",
            "aliases": trl_spellings("block_size"),
        },
    )
    packing: str | None = field(
        default=None,
        metadata={
            "help": "Unset or TRL's false (TRL's default): one example per row, truncated at block_size, padded. "
            "concat: text documents are concatenated and cut into block_size blocks (a token may attend to the "
            "previous document). padding_free: each document (at most block_size tokens; longer ones are split) keeps "
            "its own positions, and a batch is one row of whole documents that attend only within themselves "
            "(transformers' DataCollatorWithFlattening: no padding, no cross-document attention; chat data too). "
            "TRL's true is padding_free (packing_strategy bfd truncates long documents, bfd_split splits them, "
            "wrapped is concat). A bare --packing is TRL's true.",
            "choices": ["concat", "padding_free", "true", "false"],
            "nargs": "?",
            # TRL's packing is a bool: its users write --packing alone for true
            "const": "true",
        },
    )
    packing_strategy: str | None = field(
        default=None,
        metadata={
            "help": "TRL's, with packing true: wrapped is concat; bfd_split is padding_free (a long document is "
            "split); bfd (TRL's default) is padding_free with a long text document truncated, as TRL's bfd does.",
            "choices": ["bfd", "bfd_split", "wrapped"],
        },
    )
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's, for chat data: true trains on the assistant's tokens only, false on the whole "
            "conversation (TRL's default); unset is the assistant's tokens, said in one line. Refused for text data."
        },
    )
    auto_insert_empty_system_msg: bool = field(
        default=False,
        metadata={
            "help": "The alignment handbook's (true by default in its older dataset_mixer format, where it is set "
            "so): chat data gets an empty system turn first in each conversation without one, when the chat "
            "template mentions a system turn ('system' or <|im_start|>)."
        },
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's. Prompt-completion datasets have no equivalent here, so true is refused; false (or "
            "unset) is what text and chat data do already."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N raw examples (for quick runs)."}
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={"help": "Processes for tokenization.", "aliases": trl_spellings("preprocessing_num_workers")},
    )
    validation_file: str | None = field(
        default=None,
        metadata={
            "help": "Local evaluation file, in the same format as train_file. Evaluation runs at "
            "eval_strategy/eval_steps and at the end; eval_loss and eval_perplexity land in the metrics."
        },
    )
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Evaluate on this split of dataset_name (e.g. validation)."}
    )
    validation_split_percentage: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate on this share (1-50 percent) of the training data, held out from training (seeded)."
        },
    )

    def __post_init__(self):
        check(self)
        if self.dataset_mixture is not None:
            # a mixture is the one source: dataset_name and train_file are refused beside it
            mixture_problem(self)
        elif (self.dataset_name is None) == (self.train_file is None):
            raise RecipeError(
                "set exactly one of dataset_name (hub) and train_file (local); got "
                f"dataset_name={self.dataset_name!r}, "
                f"train_file={self.train_file!r}"
            )
        if self.dataset_name is not None and (problem := dataset_source_problem(self.dataset_name)):
            raise RecipeError(f"dataset_name={self.dataset_name!r} {problem}")
        if self.train_file is not None:
            path = Path(self.train_file)
            if path.suffix not in DATA_EXTENSIONS:
                raise RecipeError(
                    f"train_file={self.train_file!r}: unsupported extension {path.suffix!r}; use one of "
                    f"{', '.join(sorted(DATA_EXTENSIONS))}"
                )
            # a missing path, a folder, a FIFO or device, named as such
            if problem := train_file_problem(path, self):
                raise RecipeError(f"train_file={self.train_file!r}: {problem}")
        if self.dataset_mixture is not None and (self.dataset_config_name is not None or self.dataset_split != "train"):
            raise RecipeError(
                "dataset_config_name and dataset_split pick a configuration and a split of dataset_name; a mixture "
                "gives each of its datasets its own (config, split): drop them"
            )
        # a local source's splits and configurations, as datasets has them
        if problem := local_source_problem(self):
            raise RecipeError(problem)
        self._trl_names()
        if (
            self.data_format == "auto"
            and self.train_file is not None
            and (fmt := sniff_format(Path(self.train_file), self))
        ):
            # else found only once the launch has loaded the data
            if problem := self.format_problem(fmt):
                raise RecipeError(f"train_file={self.train_file!r} is {fmt} data: {problem}")
        if self.block_size is None:
            raise RecipeError(
                "block_size (TRL's max_length) is null: TRL's no-truncation has no equivalent here; give a "
                "number of tokens"
            )
        sources = [k for k in EVAL_SOURCES if getattr(self, k) is not None]
        if len(sources) > 1:
            raise RecipeError(f"set one evaluation source, not {' and '.join(sources)}")
        if self.dataset_test_split is not None and self.dataset_name is None:
            raise RecipeError(
                "dataset_test_split is a split of dataset_name: with a local train_file give validation_file "
                "or validation_split_percentage"
            )
        if self.validation_file is not None:
            path = Path(self.validation_file)
            if self.train_file is not None and path.suffix != Path(self.train_file).suffix:
                raise RecipeError(
                    f"validation_file={self.validation_file!r} is a {path.suffix} and train_file a "
                    f"{Path(self.train_file).suffix}: give both in the same format"
                )
            if path.suffix not in DATA_EXTENSIONS:
                raise RecipeError(
                    f"validation_file={self.validation_file!r}: unsupported extension {path.suffix!r}; use one "
                    f"of {', '.join(sorted(DATA_EXTENSIONS))}"
                )
            if problem := train_file_problem(path, self):
                raise RecipeError(f"validation_file={self.validation_file!r}: {problem}")

    def _trl_names(self):
        """TRL's packing true/false and packing_strategy become our packing mode; what has no equivalent is refused
        here, or once the data's format is known (format_problem)."""
        # unset: TRL's
        trl_packing = {"true": True, "false": False, "none": False}.get(str(self.packing).lower())
        if self.packing_strategy is not None and trl_packing is not True:
            raise RecipeError(
                f"packing_strategy={self.packing_strategy} is TRL's choice for packing: true; packing is "
                f"{self.packing or 'unset (false)'}: drop packing_strategy, or set packing: true"
            )
        if self.completion_only_loss:
            raise RecipeError(
                "completion_only_loss=true is for TRL's prompt-completion datasets, which have no equivalent "
                "here: give chat data (messages; loss on assistant tokens) or drop completion_only_loss"
            )
        self.trl_packing = trl_packing
        if trl_packing is not None:
            self.packing = "concat" if trl_packing is False or self.packing_strategy == "wrapped" else "padding_free"
        if self.data_format != "auto" and (problem := self.format_problem(self.data_format)):
            raise RecipeError(problem)

    def format_problem(self, fmt: str) -> str | None:
        """Why a TRL setting given here has no equivalent for data of this format (text or chat), or None."""
        if fmt == "chat" and self.trl_packing and self.packing_strategy == "wrapped":
            return (
                "packing=true with TRL's packing_strategy wrapped joins conversations into fixed blocks; chat "
                "data here "
                "is packed without mixing conversations (padding_free) or kept one per row: set packing_strategy: bfd "
                "(or packing: padding_free)"
            )
        if fmt == "text" and self.assistant_only_loss:
            return "assistant_only_loss=true needs chat data (a messages column); this data is text: drop it"
        return None

    @property
    def evaluates(self) -> bool:
        return any(getattr(self, k) is not None for k in EVAL_SOURCES) or mixture_evaluates(self.dataset_mixture)


def build(cls, raw):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(raw).items() if k in names})
