"""Script-level arguments and recipe parsing: a recipe YAML sets the defaults, command-line flags win."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser, TrainingArguments

from fsdp_recipes.compat import cpu_fsdp
from fsdp_recipes.config import launcher
from fsdp_recipes.bounded import YAML_LIMIT, UnreadableFile, load_json
from fsdp_recipes.config.accelerate_config import ZERO1_UNDER_FSDP
from fsdp_recipes.train.preflight import Preflight
from fsdp_recipes.tiny import REPO_ROOT

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
    # LoRA with peft, under the names TRL uses (trl.ModelConfig), so recipes carry over.
    use_peft: bool = field(
        default=False,
        metadata={"help": "Train a LoRA adapter (peft) instead of all weights, sharded by FSDP like the rest. The run ends "
                  "with the merged model in output_dir and the adapter in output_dir/adapter/."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt, e.g. q_proj v_proj (default: every linear layer but the LM head)."},
    )

    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "QLoRA: load the base weights in 4 bits with bitsandbytes (CUDA only) and train a LoRA adapter "
                  "(needs use_peft and model_name_or_path)."},
    )
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit data type: nf4 or fp4.", "choices": ["nf4", "fp4"]})
    bnb_4bit_compute_dtype: str = field(
        default="bfloat16", metadata={"help": "dtype the 4-bit weights are dequantized to for compute.", "choices": ["bfloat16", "float16", "float32"]},
    )
    bnb_4bit_quant_storage: str = field(
        default="bfloat16",
        metadata={"help": "dtype the packed 4-bit weights are stored in. Under FSDP it must equal the dtype of the model's "
                  "other parameters (dtype): FSDP shards all of a unit's parameters as one dtype.",
                  "choices": ["bfloat16", "float16", "float32", "uint8"]},
    )
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Quantize the quantization constants too (double quantization)."})

    def __post_init__(self):
        if (self.model_name_or_path is None) == (self.config_name is None):
            raise RecipeError(
                "set exactly one of model_name_or_path (fine-tune weights) and config_name (train from scratch); "
                f"got model_name_or_path={self.model_name_or_path!r}, config_name={self.config_name!r}"
            )
        if self.dtype not in DTYPES:
            raise RecipeError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.load_in_4bit:
            if not (self.use_peft and self.model_name_or_path):
                raise RecipeError("load_in_4bit (QLoRA) quantizes pre-trained weights and trains a LoRA adapter on them: "
                                  "set use_peft: true and model_name_or_path")
            if problem := qlora_problem():
                raise RecipeError(problem)
        if self.use_peft and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            raise RecipeError(f"LoRA needs lora_r >= 1, lora_alpha > 0 and 0 <= lora_dropout < 1; got r={self.lora_r}, "
                              f"alpha={self.lora_alpha}, dropout={self.lora_dropout}")
        if self.config_name is not None and not Path(self.config_name).exists():
            raise RecipeError(f"config_name={self.config_name!r} does not exist: give a folder holding config.json")
        defaulted = self.tokenizer_name is None
        if defaulted:
            self.tokenizer_name = self.model_name_or_path or self.config_name
        for key, weights in (("model_name_or_path", True), ("tokenizer_name", False)):
            if getattr(self, key) is not None and (problem := model_source_problem(getattr(self, key), weights)):
                origin = f" (from {'model_name_or_path' if self.model_name_or_path else 'config_name'}: none was given)" if key == "tokenizer_name" and defaulted else ""
                raise RecipeError(f"{key}={getattr(self, key)!r}{origin} {problem}")


def qlora_problem() -> str | None:
    """QLoRA needs bitsandbytes' 4-bit kernels: CUDA and the bitsandbytes package."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return ("load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit weights have no CPU path to train with; "
                "on this machine use use_peft without load_in_4bit (LoRA on full-precision weights)")
    if importlib.util.find_spec("bitsandbytes") is None:
        return "load_in_4bit (QLoRA) needs bitsandbytes: pip install bitsandbytes"
    return None


TOKENIZER_SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one loads
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_source_problem(name: str, weights: bool) -> str | None:
    """Why a local folder or hub id cannot be loaded, found without loading it (None when it looks loadable).
    Hub ids are only checked offline (HF_HUB_OFFLINE=1), against the local cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "pytorch_model_fsdp_0").is_dir() and weights:
            return (
                f"is a sharded FSDP checkpoint: merge it first (python tools/merge_checkpoint.py {name} MERGED) and "
                "fine-tune from MERGED, or continue its run with --resume_from_checkpoint"
            )
        if not weights:  # a tokenizer: its own files, with or without a model's config.json
            if not any((path / f).is_file() for f in TOKENIZER_SOURCE_FILES):
                return (f"has no tokenizer files ({', '.join(TOKENIZER_SOURCE_FILES)}): pass --tokenizer_name with a folder or "
                        "hub id that has them (this repository's tiny one: assets/tiny-llama)")
            return None
        if not (path / "config.json").is_file():
            return "is a folder without config.json: give a folder written by save_pretrained or tools/merge_checkpoint.py"
        if weights and not any((path / f).is_file() for f in WEIGHT_FILES):
            return f"has no weights ({', '.join(WEIGHT_FILES)}): give a folder written by save_pretrained or tools/merge_checkpoint.py"
        return None
    if path.exists():
        return "is a file: give the folder that holds config.json"
    parts = name.split("/")
    if name.startswith(("/", "./", "../", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir()):
        return "does not exist (relative paths start where you launch): give a local model folder or a hub id"
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        return "is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE=1 forbids downloading it"
    return None


EVAL_SOURCES = ("validation_file", "dataset_test_split", "validation_split_percentage")  # DataArguments' evaluation data


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
    packing: str = field(
        default="concat",
        metadata={
            "help": "concat: text documents are concatenated and cut into block_size blocks (a token may attend to the "
            "previous document). padding_free: each document (at most block_size tokens; longer ones are split) keeps "
            "its own positions, and a batch is one row of whole documents that attend only within themselves "
            "(transformers' DataCollatorWithFlattening: no padding, no cross-document attention; chat data too).",
            "choices": ["concat", "padding_free"],
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N raw examples (for quick runs)."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    validation_file: str | None = field(
        default=None, metadata={"help": "Local evaluation file, in the same format as train_file. Evaluation runs at "
                                "eval_strategy/eval_steps and at the end; eval_loss and eval_perplexity land in the metrics."},
    )
    dataset_test_split: str | None = field(default=None, metadata={"help": "Evaluate on this split of dataset_name (e.g. validation)."})
    validation_split_percentage: int | None = field(
        default=None, metadata={"help": "Evaluate on this share (1-50 percent) of the training data, held out from training (seeded)."},
    )

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
            if problem := train_file_problem(path, self):
                raise RecipeError(f"train_file={self.train_file!r}: {problem}")
        if self.data_format not in ("auto", "text", "chat"):
            raise RecipeError(f"data_format={self.data_format!r} is not one of auto, text, chat")
        if self.block_size < 8:
            raise RecipeError(f"block_size={self.block_size} is too small: use at least 8 tokens")
        sources = [k for k in EVAL_SOURCES if getattr(self, k) is not None]
        if len(sources) > 1:
            raise RecipeError(f"set one evaluation source, not {' and '.join(sources)}")
        if self.dataset_test_split is not None and self.dataset_name is None:
            raise RecipeError("dataset_test_split is a split of dataset_name: with a local train_file give validation_file "
                              "or validation_split_percentage")
        if self.validation_split_percentage is not None and not 1 <= self.validation_split_percentage <= 50:
            raise RecipeError(f"validation_split_percentage={self.validation_split_percentage} is not between 1 and 50")
        if self.validation_file is not None:
            path = Path(self.validation_file)
            if self.train_file is not None and path.suffix != Path(self.train_file).suffix:
                raise RecipeError(f"validation_file={self.validation_file!r} is a {path.suffix} and train_file a "
                                  f"{Path(self.train_file).suffix}: give both in the same format")
            if path.suffix not in DATA_EXTENSIONS or not path.is_file():
                raise RecipeError(f"validation_file={self.validation_file!r} does not exist or is not one of {', '.join(sorted(DATA_EXTENSIONS))}")
            if problem := train_file_problem(path, self):
                raise RecipeError(f"validation_file={self.validation_file!r}: {problem}")

    @property
    def evaluates(self) -> bool:
        return any(getattr(self, k) is not None for k in EVAL_SOURCES)


SAMPLE_BYTES = 1 << 20  # the part of a data file checked before anything starts: the first MiB


def train_file_problem(path: Path, args: DataArguments) -> str | None:
    """What makes a local data file unusable, from its first MiB (the whole file is read after the process group
    exists, by datasets, where a bad line would be a traceback on every rank): empty, not UTF-8 text, JSON lines
    that do not parse, chat messages that are not role/content turns, no assistant turn to train on."""
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


def _csv_problem(text: str, cut: bool, args: DataArguments) -> str | None:
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


# Keys of the embedded default recipe that point into this repository: anchored here so the default
# runs from any working directory. Paths in user recipes stay relative to the working directory.
_REPO_PATH_KEYS = ("config_name", "tokenizer_name", "model_name_or_path", "train_file")


def load_recipe(path: Path, anchor_paths: bool = False) -> dict:
    """The recipe's mapping, read within bounds (fsdp_recipes.bounded: no folder, pipe, device, oversize or binary
    file, no YAML aliases); every refusal is a RecipeError naming the file and the fix."""
    from fsdp_recipes.bounded import UnreadableFile, load_yaml

    if not os.path.lexists(path):
        raise RecipeError(f"recipe {str(path)!r} does not exist: give a YAML file such as {DEFAULT_RECIPE.relative_to(REPO_ROOT)}")
    try:
        recipe = load_yaml(path, "recipe")
    except UnreadableFile as err:
        raise RecipeError(str(err)) from None
    if anchor_paths:
        for key in _REPO_PATH_KEYS:
            if isinstance(recipe.get(key), str) and not Path(recipe[key]).is_absolute():
                recipe[key] = str(REPO_ROOT / recipe[key])
    return recipe


@dataclass
class RunArguments:
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train from scratch into an output_dir that holds another run: its checkpoint-N folders are deleted first."},
    )
    allow_no_fsdp: bool = field(
        default=False,
        metadata={"help": "Train without FSDP on purpose (debugging). A launch without an FSDP config is otherwise refused: "
                  "`python train_fsdp.py` or `accelerate launch` with no config would train one unsharded model and exit 0."},
    )
    zero1: bool = field(
        default=False,
        metadata={"help": "ZeRO stage 1 under DDP (accelerate_configs/ddp.yaml): each of the N processes keeps 1/N of the "
                  "optimizer state (torch's ZeroRedundancyOptimizer); parameters and gradients stay replicated. FSDP "
                  "configs shard the optimizer state already."},
    )
    profile_steps: str | None = field(
        default=None,
        metadata={"help": "Profile these optimizer steps, e.g. 5-8: a Chrome trace per rank in output_dir/profile/ "
                  "(and a CUDA memory snapshot on GPUs), and one line with the share of time in all-gather, "
                  "reduce-scatter and all-reduce and how much of it overlapped compute."},
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "The GPU's dense bf16 peak in TFLOPS, for MFU in the logs (default: from a table of common "
                  "GPUs, fsdp_recipes/train/metrics.py). MFU is not reported on CPU."},
    )


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, Preflight]:
    """``[recipe.yaml] [--flag value ...]``; with no recipe, the embedded default recipe is used.

    Reads and checks only: no file is moved, nothing is patched, no process group is joined. What the run then
    does before loading anything (build TrainingArguments, which joins the process group; take output_dir; set
    checkpoints aside) is the returned Preflight, carried out by train_fsdp.py. Bad input therefore fails on each
    rank in seconds and leaves nothing behind.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, RunArguments, TrainingArguments),
        usage="accelerate launch --config_file accelerate_configs/zero3.yaml train_fsdp.py [recipe.yaml] [--flag value ...]",
        description="Train a causal LM with FSDP. The optional first argument is a recipe YAML whose keys set the "
        "defaults of every argument below; flags override it (without a recipe: recipes/tiny-llama/pretrain.yaml). "
        "A model or data source given as a flag replaces the recipe's. Resume with --resume_from_checkpoint true "
        "(the newest complete checkpoint in output_dir) or a checkpoint-N folder.",
    )
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        recipe = load_recipe(Path(argv.pop(0)))
    elif argv and not argv[0].startswith("-"):
        raise RecipeError(f"{argv[0]!r} is not a recipe: give a .yaml file first, then --flags")
    else:
        recipe = load_recipe(DEFAULT_RECIPE, anchor_paths=True)
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(recipe) - known)
    if unknown:
        raise RecipeError(f"unknown recipe key(s): {with_hints(unknown, known)}; see `train_fsdp.py --help`")
    check_flags(argv, parser)
    check_flag_values(argv, parser)
    check_flag_words(argv, parser)
    check_recipe_types(recipe, parser)
    given = {a.split("=", 1)[0].removeprefix("--") for a in argv if a.startswith("--")}
    for pair in (("model_name_or_path", "config_name"), ("dataset_name", "train_file")):
        if given & set(pair):  # a source on the command line replaces the recipe's, whichever kind it is
            for key in set(pair) - given:
                recipe.pop(key, None)
    parser.set_defaults(**recipe)
    raw = parser.parse_args(argv)  # plain values: no dataclass, no process group yet
    trainer_fsdp = check_trainer_fsdp(raw)  # the torchrun route: TrainingArguments' own --fsdp
    if problem := cpu_fsdp.single_process_problem(trainer_fsdp):
        raise RecipeError(problem)
    plan = Preflight(raw, trainer_fsdp)
    check_launch(raw, plan)
    model_args, data_args, run_args = (build(cls, raw) for cls in (ModelArguments, DataArguments, RunArguments))
    check_training_values(raw, model_args, data_args)
    plan.run_args = run_args
    output_dir = raw.output_dir or "trainer_output"
    plan.resume = resolve_resume(raw.resume_from_checkpoint, output_dir, trainer_fsdp, plan)
    plan.requeue_record = check_requeue(output_dir, plan.resume)
    inputs = {"model_name_or_path": model_args.model_name_or_path, "config_name": model_args.config_name,
              "tokenizer_name": model_args.tokenizer_name}
    check_output_dir(output_dir, resuming=plan.resume is not None, overwrite=run_args.overwrite_output_dir, plan=plan,
                     resume=plan.resume, inputs=inputs)
    fsdp = cpu_fsdp.fsdp_requested() or trainer_fsdp
    if not fsdp and not run_args.allow_no_fsdp and not (plan.launch is not None and plan.launch.ddp):
        raise RecipeError(launcher.no_fsdp_problem())
    if run_args.zero1 and cpu_fsdp.launched_world_size() < 2:
        raise RecipeError("zero1 shards the optimizer state across processes and this launch has 1: launch with "
                          "--config_file accelerate_configs/ddp.yaml (2+ processes), or drop zero1")
    if run_args.zero1 and fsdp:  # the accelerate-launch route is named by the config check above, by file and key
        raise RecipeError(f"zero1 {ZERO1_UNDER_FSDP}: drop zero1, or launch with accelerate_configs/ddp.yaml")
    if warning := launcher.unused_accelerators_warning():
        _say(warning)
    return model_args, data_args, plan


def check_training_values(raw, model_args: ModelArguments, data_args: DataArguments) -> None:
    """Values TrainingArguments accepts that train nothing, or the wrong thing, without a word."""
    if raw.output_dir is not None and not str(raw.output_dir).strip():  # TrainingArguments would os.makedirs('')
        raise RecipeError(f"output_dir={raw.output_dir!r} is empty: give the folder to write the run to")
    if raw.max_steps == 0:
        raise RecipeError("max_steps=0 would still train one step and save checkpoint-1: give a positive number of "
                          "steps, or leave max_steps at -1 to train num_train_epochs")
    if raw.learning_rate < 0:
        raise RecipeError(f"learning_rate={raw.learning_rate} is negative: give a positive rate such as 2e-5")
    check_value_ranges(raw)  # every numeric field: finite, and within its rule (VALUE_RULES)
    if raw.learning_rate == 0:  # a load check may want exactly this; a training run never does
        _say("warning: learning_rate=0: the weights will not change (fine to check that a model loads; not training)")
    if raw.learning_rate * raw.weight_decay >= 1:  # the decay multiplies each weight by 1 - lr x wd every step
        raise RecipeError(f"weight_decay={_shown(raw.weight_decay)} with learning_rate={_shown(raw.learning_rate)} would "
                          f"multiply every weight by 1 - learning_rate x weight_decay = {1 - raw.learning_rate * raw.weight_decay:.3g} "
                          f"each step, before any gradient: give a weight_decay below {1 / raw.learning_rate:g}, e.g. 0.01")
    if raw.max_steps > 0 and raw.warmup_steps >= 1:
        warn_long_warmup(raw.warmup_steps, raw.max_steps, raw.learning_rate)
    if str(raw.eval_strategy or "no").lower() not in ("no", "intervalstrategy.no") and not data_args.evaluates:
        raise RecipeError(f"eval_strategy={raw.eval_strategy} needs evaluation data: set validation_file, "
                          "validation_split_percentage or dataset_test_split")
    if raw.profile_steps is not None:
        from fsdp_recipes.train.profiling import parse_steps

        try:
            first, last = parse_steps(str(raw.profile_steps))
        except ValueError as err:
            raise RecipeError(f"profile_steps={err}") from None
        if raw.max_steps > 0 and last > raw.max_steps:
            raise RecipeError(f"profile_steps={raw.profile_steps} ends after max_steps={raw.max_steps}: profile steps within the run")
    positions = model_positions(model_args.model_name_or_path or model_args.config_name)
    if positions is not None and data_args.block_size > positions:
        raise RecipeError(f"block_size={data_args.block_size} is longer than the model's {positions} positions: "
                          f"use block_size {positions} or less")


@dataclass(frozen=True)
class Rule:
    """The values a numeric field accepts: from ``low`` to ``high`` (an end marked open is itself refused), plus
    ``special`` values with a meaning of their own (max_steps -1: train num_train_epochs). ``fraction``: a step
    count where transformers 5 reads a float in (0, 1) as a fraction of the run; from 1 up it must be a whole
    number. ``strategy``: the field is read only when that strategy is "steps" (otherwise only finite)."""

    low: float
    high: float
    fix: str  # what to give instead: the part of the message after the colon
    low_open: bool = False
    high_open: bool = False
    special: tuple = ()
    fraction: bool = False
    strategy: str | None = None


INF = float("inf")
SEED_MAX = 2**32 - 1  # transformers' set_seed seeds numpy, which refuses more
MAX_COUNT = 2**63 - 1  # the largest int64: whole numbers (counts, steps, sizes) beyond it overflow where torch keeps them
STEPS_FIX = "give a whole number of optimizer steps, or a fraction of the run below 1 (0.1: every tenth of it)"
# Worker processes (dataloader_num_workers per training process, preprocessing_num_workers for datasets.map) are
# forked as asked: 100000 forked until the machine stopped. More than a few per core only queue for the cores, so
# the bound follows this machine (computed once, at import); 64 stays allowed on small machines, where a recipe
# written for a large node may still ask for that many.
CPUS = os.cpu_count() or 1
MAX_WORKERS = max(64, 4 * CPUS)
WORKERS_BOUND = f"at most {MAX_WORKERS}: max(64, 4 x the {CPUS} CPUs of this machine)"

# A rule for every int or float field of ModelArguments, DataArguments, RunArguments and TrainingArguments
# (numeric_fields()); tests/test_training_values.py fails for a field that has neither a rule here nor a place in
# FINITE_ONLY, so a field a new transformers adds gets a decision.
VALUE_RULES: dict[str, Rule] = {
    # ModelArguments: refused even without use_peft, where they are unused: such a value is a typo either way
    "lora_r": Rule(1, INF, "give the LoRA rank, e.g. 16"),
    "lora_alpha": Rule(1, INF, "give a positive alpha, e.g. twice lora_r (the update is scaled by alpha / r)"),
    "lora_dropout": Rule(0, 1, "give a dropout probability below 1, e.g. 0.05", high_open=True),
    # DataArguments
    "block_size": Rule(8, INF, "use at least 8 tokens"),
    "max_train_samples": Rule(1, INF, "keep at least 1 example, or leave it unset to train on all of them"),
    "preprocessing_num_workers": Rule(1, MAX_WORKERS, f"give 1 or more tokenizing processes ({WORKERS_BOUND}), or leave it unset to tokenize in the training process"),
    "validation_split_percentage": Rule(1, 50, "hold out between 1 and 50 percent"),
    # RunArguments
    "peak_tflops": Rule(0, INF, "give the GPU's dense bf16 peak in TFLOPS (989 for an H100 SXM), or leave it unset", low_open=True),
    # TrainingArguments
    "per_device_train_batch_size": Rule(1, INF, "give at least 1 example per process and micro-batch"),
    "per_device_eval_batch_size": Rule(1, INF, "give at least 1 example per process and evaluation batch"),
    "num_train_epochs": Rule(0, MAX_COUNT, "give a positive number of epochs (0.5 trains half of one), or a positive max_steps", low_open=True),
    "max_steps": Rule(1, INF, "give a positive number of optimizer steps, or -1 to train num_train_epochs", special=(-1,)),
    "learning_rate": Rule(0, 10, "give a rate such as 2e-5 (an Adam-type optimizer moves each weight by about that much a step)"),
    "warmup_steps": Rule(0, MAX_COUNT, "give a whole number of warmup steps, or a fraction of the run below 1 (0.1: the first tenth)", fraction=True),
    "weight_decay": Rule(0, INF, "give 0 for none, or a coefficient such as 0.01"),
    "adam_beta1": Rule(0, 1, "give a decay rate below 1, e.g. 0.9", high_open=True),
    "adam_beta2": Rule(0, 1, "give a decay rate below 1, e.g. 0.999", high_open=True),
    "adam_epsilon": Rule(0, 1, "give a small positive number, e.g. 1e-8 (the update is divided by it plus the gradient's scale)", low_open=True),
    "gradient_accumulation_steps": Rule(1, INF, "give 1 (no accumulation) or more micro-batches per optimizer step"),
    "max_grad_norm": Rule(0, INF, "give the clipping threshold, e.g. 1.0, or 0 not to clip"),
    "label_smoothing_factor": Rule(0, 1, "give 0 for none, or a factor below 1 such as 0.1 (1 would train towards uniform guesses)", high_open=True),
    "neftune_noise_alpha": Rule(0, INF, "give a positive noise scale such as 5, or leave it unset for no noise", low_open=True),
    "torch_empty_cache_steps": Rule(1, INF, "give a positive number of steps, or leave it unset"),
    "logging_steps": Rule(0, MAX_COUNT, STEPS_FIX, low_open=True, fraction=True, strategy="logging_strategy"),
    "eval_steps": Rule(0, MAX_COUNT, STEPS_FIX + ", or leave it unset to evaluate every logging_steps", low_open=True, fraction=True, strategy="eval_strategy"),
    "save_steps": Rule(0, MAX_COUNT, STEPS_FIX, low_open=True, fraction=True, strategy="save_strategy"),
    "eval_delay": Rule(0, MAX_COUNT, "give 0 to evaluate from the start, or the epochs or steps to wait first"),
    "eval_accumulation_steps": Rule(1, INF, "give a positive number of steps, or leave it unset"),
    "save_total_limit": Rule(1, INF, "keep at least 1 checkpoint, or leave it unset to keep them all"),
    "seed": Rule(0, SEED_MAX, f"give a seed from 0 to {SEED_MAX}"),
    "data_seed": Rule(0, SEED_MAX, f"give a seed from 0 to {SEED_MAX}, or leave it unset to use seed"),
    "dataloader_num_workers": Rule(0, MAX_WORKERS, f"give 0 to load batches in the training process, or a number of worker processes ({WORKERS_BOUND})"),
    "dataloader_prefetch_factor": Rule(1, INF, "give a positive number of batches per worker, or leave it unset"),
    "ddp_bucket_cap_mb": Rule(1, INF, "give a positive bucket size in MB, or leave it unset"),
    "ddp_timeout": Rule(1, INF, "give the collectives' timeout in seconds, e.g. 1800"),
    "local_rank": Rule(0, INF, "leave it to the launcher (-1: not launched)", special=(-1,)),
}
# Numeric fields with no range of their own, on purpose (name -> why): checked as finite numbers only.
FINITE_ONLY: dict[str, str] = {}


_numeric: dict[str, type] = {}  # numeric_fields(), found once: the dataclasses do not change while we run


def numeric_fields() -> dict[str, type]:
    """Every int or float field (None allowed or not) of the dataclasses parse_args builds, by name: int or float."""
    import typing

    if not _numeric:
        for cls in (ModelArguments, DataArguments, RunArguments, TrainingArguments):
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}  # bool is its own type, not in {int, float}
                if f.init and kinds & {int, float}:
                    _numeric[f.name] = float if float in kinds else int
    return dict(_numeric)


def _shown(value) -> str:
    """A number as a flag would give it: 0 rather than 0.0, 1e+30 as Python writes it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def _steps_strategy(raw, key: str) -> bool:
    value = getattr(raw, key, None)
    return str(getattr(value, "value", value)).lower() == "steps"  # a string from argparse, an enum from a caller


def value_problem(name: str, value, raw=None) -> str | None:
    """Why ``value`` is refused for the numeric field ``name`` (None: it is fine). Anything but a finite number,
    or an integer beyond int64, is refused for every field, with a rule or without; then the field's rule applies.
    ``raw`` (the other values) tells whether a step interval is read at all; without it, it is."""
    import math

    rule = VALUE_RULES.get(name)
    fix = rule.fix if rule else "give a finite number"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} is not a number: {fix}"
    shown = _shown(value)
    if not math.isfinite(value):
        return f"{name}={shown} is not a finite number: {fix}"
    if isinstance(value, int) and abs(value) > MAX_COUNT:
        return f"{name}={shown} is beyond {MAX_COUNT}, the largest 64-bit integer: {fix}"
    if rule is None or value in rule.special:
        return None
    if rule.strategy and raw is not None and not _steps_strategy(raw, rule.strategy):
        # logging_steps is also the evaluation interval when eval_strategy is steps and eval_steps is unset
        if not (name == "logging_steps" and _steps_strategy(raw, "eval_strategy") and not getattr(raw, "eval_steps", None)):
            return None
    if value < rule.low or (rule.low_open and value == rule.low):
        why = ("is not positive" if rule.low == 0 else f"is not above {_shown(rule.low)}") if rule.low_open else f"is less than {_shown(rule.low)}"
    elif value > rule.high or (rule.high_open and value == rule.high):
        why = f"is not below {_shown(rule.high)}" if rule.high_open else f"is more than {_shown(rule.high)}"
    elif rule.fraction and value > 1 and not float(value).is_integer():
        why = "is neither a fraction of the run (below 1) nor a whole number of steps"
    else:
        return None
    return f"{name}={shown} {why}: {fix}"


def check_value_ranges(raw) -> None:
    """Every numeric field parse_args gives, against its rule: one line naming the first that is out of range."""
    for name in numeric_fields():
        if problem := value_problem(name, getattr(raw, name, None), raw):
            raise RecipeError(problem)


def check_flag_values(argv: list[str], parser) -> None:
    """A number flag whose value is not a number is one line naming it (argparse would print its usage and exit
    with status 2 on every rank), as is a negative value argparse would take for a flag (-inf, -1e-4)."""
    actions = {s: a for a in parser._actions for s in a.option_strings if a.type in (int, float)}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if (action := actions.get(flag)) is None:
            continue
        name, kind = action.dest, "a whole number" if action.type is int else "a number"
        if not eq:
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise RecipeError(f"{name} has no value: give {kind} after --{name}")
            value = argv[i + 1]
            if value.startswith("-") and not _argparse_reads_as_value(value):
                raise RecipeError(f"{name}={value} would be read as a flag: write --{name}={value}")
        try:
            action.type(value)
        except ValueError:
            try:
                whole = float(value)
            except ValueError:
                whole = None
            hint = f"write it as {int(whole)}" if action.type is int and whole is not None and whole.is_integer() else f"give {kind}"
            raise RecipeError(f"{name}={value!r} is not {kind}: {hint}") from None


def check_flag_words(argv: list[str], parser) -> None:
    """A true/false flag given a word that is neither, or a flag given a value outside its choices: one line naming
    it (argparse would print its usage and exit with status 2 on every rank)."""
    actions = {s: a for a in parser._actions for s in a.option_strings if a.type not in (None, int, float) or a.choices}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if (action := actions.get(flag)) is None:
            continue
        if not eq:
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                continue  # a bare true/false flag means true; argparse names a missing value itself
            value = argv[i + 1]
        try:
            converted = action.type(value) if action.type is not None else value
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise RecipeError(f"{action.dest}={value!r}: {str(err).rstrip('.')}") from None
        if action.choices is not None and converted not in action.choices and str(converted) not in map(str, action.choices):
            raise RecipeError(f"{action.dest}={value!r} is not one of {', '.join(map(str, action.choices))}")


def _argparse_reads_as_value(text: str) -> bool:
    """Whether argparse takes ``--flag text`` with text as the value: which negative numbers it reads as numbers
    changed across Python versions (-1e-4 is a flag to 3.11's), so this asks a parser of this Python."""
    import argparse

    probe = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    probe.add_argument("--x")
    try:
        probe.parse_args(["--x", text])
    except argparse.ArgumentError:
        return False
    return True


def warn_long_warmup(warmup_steps: float, total_steps: int, learning_rate: float) -> None:
    """Legitimate (a learning-rate range test warms up over the whole run) but rarely meant: said, not refused."""
    if warmup_steps >= total_steps:
        _say(f"warning: warmup_steps={_shown(warmup_steps)} covers the whole run of {total_steps} optimizer steps: "
             f"the learning rate never reaches learning_rate={_shown(learning_rate)}")


def batches_per_process(examples: int, batch_size: int, processes: int, drop_last: bool = False) -> int:
    """Micro-batches one process draws in an epoch of ``examples``: the Trainer batches the dataset and accelerate
    deals the batches out to the data-parallel processes (even_batches, its default: a process left short wraps
    around to the first batches; with drop_last the incomplete batch and round are dropped instead)."""
    if drop_last:
        return examples // batch_size // processes
    return -(-(-(-examples // batch_size)) // processes)  # ceil(ceil(examples / batch_size) / processes)


def steps_per_epoch(batches: int, accumulation: int) -> int:
    """Optimizer steps an epoch gives, as the Trainer counts them (transformers 5.23,
    Trainer.set_initial_training_values): a last, shorter accumulation is a step of its own; at least 1."""
    return max(-(-batches // accumulation), 1)


def check_run_length(args, examples: int, profile_steps: str | None = None) -> int:
    """The checks that need the training set's size (train_fsdp.py, once it is built, before the Trainer is):
    an accumulation longer than an epoch, a profile past the run's end, a warmup as long as the run. ``args``:
    TrainingArguments, or anything with its fields and world_size (every process is data-parallel here: no
    tensor or context parallelism). Returns the run's optimizer steps."""
    import math

    size, processes, accumulation = args.per_device_train_batch_size, args.world_size, args.gradient_accumulation_steps
    batches = batches_per_process(examples, size, processes, args.dataloader_drop_last)
    source = f"{examples:,} examples / (per_device_train_batch_size={size} x {processes} process{'es' if processes > 1 else ''})"
    if batches == 0:
        raise RecipeError(f"per_device_train_batch_size={size} leaves no batch with dataloader_drop_last ({source}): "
                          "lower per_device_train_batch_size, drop dataloader_drop_last, or give more data")
    if batches < accumulation:  # every optimizer step would average `batches` micro-batches, not `accumulation`
        raise RecipeError(f"gradient_accumulation_steps={accumulation} is more than the {batches} micro-batch"
                          f"{'es' if batches > 1 else ''} an epoch gives each process ({source}): every optimizer step "
                          f"would average {batches} instead of {accumulation}: use gradient_accumulation_steps {batches} "
                          "or less, a smaller per_device_train_batch_size, or more data")
    per_epoch = steps_per_epoch(batches, accumulation)
    epoch_based = args.max_steps <= 0
    total = math.ceil(args.num_train_epochs * per_epoch) if epoch_based else args.max_steps
    length = f"num_train_epochs={_shown(args.num_train_epochs)} x {per_epoch} steps an epoch" if epoch_based else f"max_steps={args.max_steps}"
    if profile_steps:
        from fsdp_recipes.train.profiling import parse_steps

        first, last = parse_steps(str(profile_steps))
        if last > total:
            start = max(1, total - (last - first))  # as many steps, ending with the run
            raise RecipeError(f"profile_steps={profile_steps} ends after the run's {total} optimizer steps ({length}): "
                              f"profile steps within the run, e.g. {start}-{total}")
    if epoch_based and args.warmup_steps >= 1:  # with max_steps, parse_args has warned already
        warn_long_warmup(args.warmup_steps, total, args.learning_rate)
    return total


def model_positions(source: str | None) -> int | None:
    """The longest sequence the model's config allows, or None when its config is not on this machine (a hub
    model not yet downloaded: nothing is fetched here; the model load explains any problem later)."""
    if source is None:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception:  # an unreadable config is model_source_problem's to explain, or the load's
        return None
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)


# The fsdp_config keys TrainingArguments reads (transformers 5.23, TrainingArguments._process_fsdp_args); it
# ignores any other key silently. Keys may carry an "fsdp_" prefix; keys starting with "_" are comments.
TRAINER_FSDP_KEYS = {
    "version", "reshard_after_forward", "auto_wrap_policy", "min_num_params", "transformer_layer_cls_to_wrap",
    "state_dict_type", "cpu_ram_efficient_loading", "cpu_offload", "activation_checkpointing", "forward_prefetch",
    "backward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers",
    "xla", "xla_fsdp_settings", "xla_fsdp_v2", "xla_fsdp_grad_ckpt",
}


def check_trainer_fsdp(raw) -> bool:
    """Normalise TrainingArguments' --fsdp (the torchrun route) and check its fsdp_config; True if FSDP is asked for.

    ``--fsdp true`` arrives as the string "true", which TrainingArguments rejects ("Unknown fsdp option"): it
    becomes True, the non-deprecated form. A fsdp_config key TrainingArguments does not read is an error."""
    if isinstance(raw.fsdp, str) and raw.fsdp.lower() in ("true", "false", ""):
        raw.fsdp = raw.fsdp.lower() == "true" or None
    if not raw.fsdp:
        return False
    config = raw.fsdp_config
    if isinstance(config, str):
        if not Path(config).is_file():
            raise RecipeError(f"--fsdp_config {config!r} does not exist: give a JSON file such as accelerate_configs/torchrun/zero3.json")
        try:
            config = load_json(Path(config), "--fsdp_config", YAML_LIMIT)
        except UnreadableFile as err:
            raise RecipeError(str(err)) from None
    unknown = [k for k in (config or {}) if not k.startswith("_") and k.removeprefix("fsdp_") not in TRAINER_FSDP_KEYS]
    if unknown:
        raise RecipeError(f"fsdp_config has key(s) TrainingArguments would silently ignore: {with_hints(unknown, TRAINER_FSDP_KEYS, 'fsdp_')}")
    return True


def check_flags(argv: list[str], parser) -> None:
    """An unknown flag is one line with the closest known one (argparse would print its 120-line usage per rank)."""
    options = {s for action in parser._actions for s in action.option_strings}
    unknown = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in options]
    if unknown:
        names = {o.removeprefix("--") for o in options}
        raise RecipeError(f"unknown flag(s): {with_hints([u.removeprefix('--') for u in unknown], names)}; see `train_fsdp.py --help`")


def check_recipe_types(recipe: dict, parser) -> None:
    """Recipe values bypass argparse's conversion (they become defaults as they are): check them the same way."""
    actions = {}
    for a in parser._actions:  # a true-by-default flag has two: --name (typed) and --no_name (store_false, untyped)
        if a.dest not in actions or actions[a.dest].type is None:
            actions[a.dest] = a
    for key, value in recipe.items():
        action = actions[key]
        if value is None or action.type is None:
            continue
        many = action.nargs in ("+", "*")
        values = value if many and isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, (list, dict)):
                raise RecipeError(f"recipe key {key}: {value!r} is a {type(v).__name__}; give one {getattr(action.type, '__name__', 'value')}")
            try:
                converted = action.type(str(v).lower() if isinstance(v, bool) else v if isinstance(v, str) else str(v))
            except (TypeError, ValueError, argparse.ArgumentTypeError) as err:  # string_to_bool raises the last
                raise RecipeError(f"recipe key {key}: {v!r} is not a valid {getattr(action.type, '__name__', 'value')} ({err})") from None
            if action.choices is not None and converted not in action.choices and str(converted) not in map(str, action.choices):
                raise RecipeError(f"recipe key {key}: {v!r} is not one of {', '.join(map(str, action.choices))}")


def with_hints(unknown: list[str], known, prefix: str = "") -> str:
    """'key (did you mean known_key?), other' for an error message; ``prefix`` is ignored when matching."""
    import difflib

    hints = [(k, difflib.get_close_matches(k.removeprefix(prefix), known, 1)) for k in unknown]
    return ", ".join(f"{k} (did you mean {m[0]}?)" if m else k for k, m in hints)


def build(cls, raw):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(raw).items() if k in names})


def check_launch(raw, plan: Preflight) -> None:
    """The launcher's accelerate settings (config file, its default, launch flags or FSDP_* variables), checked
    with this run's settings by tools/check_config.py's rules. Warnings are printed once; errors stop every rank."""
    from fsdp_recipes.config.accelerate_config import errors

    plan.launch = launch = launcher.launch_settings()
    if launch is None:
        return  # nothing to check (a launch without FSDP is refused below, by name)
    fsdp_type = launch.config.get("distributed_type") == "FSDP"
    if not launch.ddp and (not (fsdp_type or "fsdp_config" in launch.config) or (raw.allow_no_fsdp and not fsdp_type)):
        return  # neither FSDP nor a DDP config (refused below, by name), or no FSDP on purpose
    settings = {k: getattr(raw, k, None) for k in ("gradient_checkpointing", "activation_checkpointing", "save_only_model", "fp16", "bf16", "dtype",
                                          "load_in_4bit", "bnb_4bit_quant_storage", "bnb_4bit_compute_dtype", "zero1")}
    problems = launcher.check(plan.launch, settings, raw.model_name_or_path or raw.config_name)
    for problem in problems:
        if problem.level == "warning":
            _say(str(problem))
    if errors(problems):
        raise RecipeError(f"{plan.launch.describe()} has {len(errors(problems))} error(s): " + " | ".join(str(p) for p in errors(problems)))


def _rank0() -> bool:
    """Every rank parses the same arguments: messages and file moves happen once, on global rank 0."""
    return os.environ.get("RANK", "0") == "0"


def _say(message: str) -> None:
    if _rank0():
        print(f"train_fsdp.py: {message}", file=sys.stderr, flush=True)


def _set_aside(path: Path, prefix: str, why: str, plan: Preflight | None) -> None:
    """Recorded in the plan (train_fsdp.py's preflight moves it), or, called without one, moved now on rank 0."""
    now = Preflight(None, False) if plan is None else plan
    now.set_aside.append((path, prefix, why))
    if plan is None and _rank0():
        now.carry_out(_say)


def resolve_resume(value: str | None, output_dir: str, trainer_fsdp: bool = False, plan: Preflight | None = None) -> str | None:
    """``true``: the newest complete checkpoint-N in output_dir (newer, incomplete ones are named and set aside);
    a path: that checkpoint, which must be complete (an earlier one of output_dir sets the later ones aside);
    ``false`` or unset: no resume."""
    from fsdp_recipes.ckpt.layout import INCOMPLETE_PREFIX
    from fsdp_recipes.ckpt.status import checkpoint_status, newest_resumable

    if value is None or str(value).lower() == "false":
        return None
    if str(value).lower() == "true":
        chosen, skipped = newest_resumable(output_dir) if Path(output_dir).is_dir() else (None, [])
        for status in skipped:
            _say(f"skipping {status.summary()}")
            _set_aside(Path(status.path), INCOMPLETE_PREFIX, "incomplete", plan)
        if chosen is None:
            what = f" (incomplete: {', '.join(Path(s.path).name for s in skipped)})" if skipped else ""
            raise RecipeError(
                f"--resume_from_checkpoint true: no complete checkpoint-N folder in output_dir {output_dir!r}{what}; "
                "start without --resume_from_checkpoint"
            )
        return _resumable(chosen, trainer_fsdp)
    if not Path(value).is_dir():
        raise RecipeError(f"--resume_from_checkpoint {value!r} is not a folder: give a checkpoint-N folder, or true for the latest")
    status = checkpoint_status(value)
    if not status.resumable:
        chosen, _ = newest_resumable(Path(value).parent)
        instead = f"resume from {chosen.path} (the newest complete one) or" if chosen else "start"
        raise RecipeError(f"cannot resume from {status.summary()}; {instead} without it")
    path = _resumable(status, trainer_fsdp)
    set_aside_later_checkpoints(Path(value), output_dir, plan)
    return path


REQUEUE_RECORD = "requeue_progress.json"  # output_dir: the newest checkpoint each requeued attempt of a job started from
MAX_STALLED_REQUEUES = 3


def check_requeue(output_dir: str, resume: str | None) -> dict | None:
    """A job SLURM requeued (SLURM_RESTART_COUNT > 0) that starts from the same checkpoint as its last attempt made no
    progress: after MAX_STALLED_REQUEUES such starts in a row it stops instead of looping forever (the time limit
    is too short to reach the next checkpoint, or the job fails before its first step). Returns the record preflight
    writes (rank 0); None outside a requeued job."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not restart.isdigit() or int(restart) == 0:
        return None
    step = int(Path(resume).name.split("-")[-1]) if resume and re.fullmatch(r"checkpoint-\d+", Path(resume).name) else 0
    try:
        last = load_json(Path(output_dir) / REQUEUE_RECORD, REQUEUE_RECORD, 4096)
        last_step, stalled = int(last["step"]), int(last["stalled"])
    except (OSError, ValueError, KeyError, TypeError):
        last_step, stalled = -1, 0
    stalled = stalled + 1 if step <= last_step else 0
    if stalled >= MAX_STALLED_REQUEUES:
        raise RecipeError(
            f"requeued {stalled} times in a row without a new checkpoint (each attempt started from "
            f"{Path(resume).name if resume else 'no checkpoint'}): not starting again; give the job a longer time limit "
            f"or checkpoint more often (save_steps), then delete {Path(output_dir) / REQUEUE_RECORD} and resubmit"
        )
    return {"restart": int(restart), "step": step, "stalled": stalled}


def set_aside_later_checkpoints(ckpt: Path, output_dir: str, plan: Preflight | None = None) -> None:
    """Resuming an earlier checkpoint of this output_dir starts another branch of the run: its later checkpoints
    would be rewritten in place (the Trainer saves into checkpoint-N as it finds it) or, being newer, picked by
    the next `--resume_from_checkpoint true`. They are moved aside as replaced-checkpoint-N; nothing is deleted."""
    from fsdp_recipes.ckpt.layout import REPLACED_PREFIX, checkpoint_steps, real

    if real(ckpt.parent) != real(output_dir) or not re.fullmatch(r"checkpoint-\d+", ckpt.name):
        return
    for later in checkpoint_steps(Path(output_dir)):
        if int(later.name.split("-")[1]) > int(ckpt.name.split("-")[1]):
            _set_aside(later, REPLACED_PREFIX, f"resuming {ckpt.name} starts a new branch of the run", plan)


def _resumable(status, trainer_fsdp: bool) -> str:
    """The checkpoint path, after checking it fits this launch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if status.state_dict_type == "SHARDED_STATE_DICT" and not (cpu_fsdp.fsdp_requested() or trainer_fsdp):
        raise RecipeError(
            f"{status.path} holds FSDP shards: resume it under FSDP (`accelerate launch --config_file "
            "accelerate_configs/<config>.yaml train_fsdp.py ...`), or merge it with tools/merge_checkpoint.py and "
            "fine-tune from the merged folder"
        )
    if status.state_dict_type == "PLAIN" and (cpu_fsdp.fsdp_requested() or trainer_fsdp):
        raise RecipeError(
            f"{status.path} was saved without FSDP (DDP or ZeRO-1): resume it with the same launch (`accelerate launch "
            "--config_file accelerate_configs/ddp.yaml train_fsdp.py ...`), or start an FSDP run from its weights with "
            f"--model_name_or_path {status.path}"
        )
    if status.world_size and status.world_size != world:
        _say(
            f"{Path(status.path).name} was saved by {status.world_size} processes, this run has {world}: the shards "
            "are resharded on load; ranks without a saved RNG state start from the seed, and the data order follows "
            "the new global batch size (keep per_device_train_batch_size x processes equal to continue the same order)"
        )
    return status.path


def check_output_dir(output_dir: str, resuming: bool, overwrite: bool, plan: Preflight | None = None,
                     resume: str | None = None, inputs: dict[str, str | None] | None = None) -> None:
    """A new run must not write into another run's checkpoints: a later `resume true` would pick theirs, rotation
    would delete them. Nor may output_dir be, hold or lie inside a local input (the final model would replace the
    model it was trained from). A resume from a checkpoint outside output_dir is a new run for this check."""
    from fsdp_recipes.ckpt.layout import (
        INCOMPLETE_PREFIX, REPLACED_PREFIX, checkpoint_steps, foreign_entries, is_checkpoint_folder, overlap, real,
    )
    if not str(output_dir).strip():
        raise RecipeError("output_dir is empty: give a folder for checkpoints and the final model, e.g. --output_dir runs/my-run")
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir {output_dir!r} is a file: choose a folder (it is created if missing)")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"output_dir {output_dir!r}: {existing} is not writable: choose a folder you can write to")
    for key, source in (inputs or {}).items():
        if source and Path(source).expanduser().exists() and overlap(real(output_dir), real(source)):
            how = "is" if real(output_dir) == real(source) else "is inside" if real(source) in real(output_dir).parents else "holds"
            raise RecipeError(f"output_dir {output_dir!r} {how} {key} {source!r}: the run's model folder would replace or "
                              "mix with its input; choose another --output_dir")
    if out.is_dir() and (foreign := foreign_entries(out)):
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise RecipeError(f"output_dir {output_dir!r} holds files a training run does not write ({shown}): the run's "
                          "checkpoints and model files would be written among them; choose an empty or new --output_dir")
    if resuming and resume is not None and real(resume).parent != real(output_dir):
        resuming = False  # another folder's checkpoint: this output_dir starts a new line of checkpoints
    if resuming or not out.is_dir():
        return
    earlier = checkpoint_steps(out) + sorted(out.glob(f"{INCOMPLETE_PREFIX}checkpoint-*")) + sorted(out.glob(f"{REPLACED_PREFIX}checkpoint-*"))
    if not earlier:
        return
    if resume is not None:
        raise RecipeError(
            f"output_dir {output_dir!r} holds another run's checkpoints ({earlier[0].name}, ...) and the resume comes from "
            f"{resume}: its new checkpoints would mix with them (and rotation delete them); resume into the checkpoint's "
            "own folder, or choose an empty --output_dir"
        )
    if not overwrite:
        names = ", ".join(p.name for p in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise RecipeError(
            f"output_dir {output_dir!r} already holds another run's checkpoints ({names}): resume it with "
            "--resume_from_checkpoint true, choose a new --output_dir, or pass --overwrite_output_dir true to delete them"
        )
    foreign = [p for p in earlier if not is_checkpoint_folder(p)]
    if foreign:
        raise RecipeError(
            f"--overwrite_output_dir: {foreign[0]} holds files a training checkpoint does not (or is a link): refusing to "
            "delete it; move what you want to keep out of it, or choose a new --output_dir"
        )
    now = Preflight(None, False) if plan is None else plan
    now.delete += earlier
    if plan is None and _rank0():
        now.carry_out(_say)
