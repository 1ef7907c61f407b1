"""Script-level arguments and recipe parsing: a recipe YAML sets the defaults, command-line flags win."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments

from .tiny import REPO_ROOT

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "tiny-llama" / "pretrain.yaml"
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}
DTYPES = ("auto", "float32", "bfloat16", "float16")


class RecipeError(ValueError):
    """A recipe or flag that cannot work; raised before any process group or model is set up."""


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub model id or local folder with weights to fine-tune. Leave unset to train from `config_name`."},
    )
    config_name: str | None = field(
        default=None,
        metadata={"help": "Folder or config.json to build a model from scratch (random init) instead of loading weights."},
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Hub id or folder of the tokenizer. Defaults to model_name_or_path, else config_name."},
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in. Keep float32 with FSDP mixed precision (bf16 in the accelerate "
            "config): FSDP then keeps fp32 master weights and computes in bf16.",
            "choices": list(DTYPES),
        },
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel, e.g. sdpa, eager, flash_attention_2. Default: transformers' choice."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub repository."})

    def __post_init__(self):
        if (self.model_name_or_path is None) == (self.config_name is None):
            raise RecipeError(
                "set exactly one of model_name_or_path (fine-tune weights) and config_name (train from scratch); "
                f"got model_name_or_path={self.model_name_or_path!r}, config_name={self.config_name!r}"
            )
        if self.dtype not in DTYPES:
            raise RecipeError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.config_name is not None and not Path(self.config_name).exists():
            raise RecipeError(f"config_name={self.config_name!r} does not exist: give a folder holding config.json")
        if self.tokenizer_name is None:
            self.tokenizer_name = self.model_name_or_path or self.config_name


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id (needs hub access)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    train_file: str | None = field(
        default=None,
        metadata={"help": f"Local training file: {', '.join(sorted(DATA_EXTENSIONS))}. Text files give one example per line."},
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
    text_column: str = field(default="text", metadata={"help": "Column holding plain text."})
    messages_column: str = field(default="messages", metadata={"help": "Column holding chat messages (role/content dicts)."})
    block_size: int = field(default=256, metadata={"help": "Tokens per packed block (text) or the truncation length (chat)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N raw examples (for quick runs)."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})

    def __post_init__(self):
        if (self.dataset_name is None) == (self.train_file is None):
            raise RecipeError(
                f"set exactly one of dataset_name (hub) and train_file (local); got dataset_name={self.dataset_name!r}, "
                f"train_file={self.train_file!r}"
            )
        if self.train_file is not None:
            path = Path(self.train_file)
            if path.suffix not in DATA_EXTENSIONS:
                raise RecipeError(
                    f"train_file={self.train_file!r}: unsupported extension {path.suffix!r}; use one of {', '.join(sorted(DATA_EXTENSIONS))}"
                )
            if not path.is_file():
                raise RecipeError(f"train_file={self.train_file!r} does not exist (paths are relative to where you launch)")
        if self.data_format not in ("auto", "text", "chat"):
            raise RecipeError(f"data_format={self.data_format!r} is not one of auto, text, chat")
        if self.block_size < 8:
            raise RecipeError(f"block_size={self.block_size} is too small: use at least 8 tokens")


# Keys of the embedded default recipe that point into this repository: anchored here so the default
# runs from any working directory. Paths in user recipes stay relative to the working directory.
_REPO_PATH_KEYS = ("config_name", "tokenizer_name", "model_name_or_path", "train_file")


def load_recipe(path: Path, anchor_paths: bool = False) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r} does not exist: give a YAML file such as {DEFAULT_RECIPE.relative_to(REPO_ROOT)}")
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe {str(path)!r} is not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {str(path)!r} must be a mapping of argument names to values")
    if anchor_paths:
        for key in _REPO_PATH_KEYS:
            if isinstance(recipe.get(key), str) and not Path(recipe[key]).is_absolute():
                recipe[key] = str(REPO_ROOT / recipe[key])
    return recipe


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, TrainingArguments]:
    """``[recipe.yaml] [--flag value ...]``; with no recipe, the embedded default recipe is used."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        recipe = load_recipe(Path(argv.pop(0)))
    elif argv and not argv[0].startswith("-"):
        raise RecipeError(f"{argv[0]!r} is not a recipe: give a .yaml file first, then --flags")
    else:
        recipe = load_recipe(DEFAULT_RECIPE, anchor_paths=True)
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(recipe) - known)
    if unknown:
        import difflib

        hints = [f"{key} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(key, known, 1)) else key for key in unknown]
        raise RecipeError(f"unknown recipe key(s): {', '.join(hints)}; see `train_fsdp.py --help`")
    parser.set_defaults(**recipe)
    try:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    except RecipeError:
        raise
    except ValueError as err:  # TrainingArguments.__post_init__ checks
        raise RecipeError(str(err).replace("\n", " ")) from None
    training_args.resume_from_checkpoint = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
    return model_args, data_args, training_args


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """``true`` means the newest ``checkpoint-N`` in output_dir; a path must exist; ``false`` or unset: no resume."""
    from transformers.trainer_utils import get_last_checkpoint

    if value is None or str(value).lower() == "false":
        return None
    if str(value).lower() == "true":
        last = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if last is None:
            raise RecipeError(f"--resume_from_checkpoint true: no checkpoint-N folder in output_dir {output_dir!r}")
        return last
    if not Path(value).is_dir():
        raise RecipeError(f"--resume_from_checkpoint {value!r} is not a folder: give a checkpoint-N folder, or true for the latest")
    return value
