"""Recipes written for TRL's ``sft.py`` and CLI and for the alignment handbook's ``scripts/sft.py`` (its current
``dataset_mixture`` format and its older ``dataset_mixer`` one), read with the meaning TRL gives each key.

:func:`translate` rewrites a recipe's TRL and handbook keys into this script's settings before the recipe is
checked: renamed keys (transformers 4's and TRL's older names, said once), dict values that TrainingArguments takes
as JSON, ``model_init_kwargs``, the dataset mixtures (one JSON plan in ``dataset_mixture``, loaded by
fsdp_recipes.train.data_mixture) and ``dataset_kwargs``; :func:`translate_flags` does the renames for flags. A key that
cannot hold here is
refused by name, with the reason, in one line. :data:`TRL_NAMES` is the table docs/training.md shows; the test
corpus of real recipes (tests/fixtures/trl/) keeps both true."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_recipes.bounded import file_kind
from fsdp_recipes.config.dict_fields import DICT_VALUED
from fsdp_recipes.config.mixture import MIXTURE_KEYS, normalize_mixture
from fsdp_recipes.config.model_source import model_source_problem
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError

# transformers 4 TrainingArguments names that transformers 5 renamed, still in TRL and handbook recipes: taken, said
RENAMED = {
    "evaluation_strategy": "eval_strategy",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "push_to_hub_model_id": "hub_model_id",
    "push_to_hub_token": "hub_token",
}
# the handbook's own spellings (its older ModelArguments): taken silently
HANDBOOK_ALIASES = {"tokenizer_name_or_path": "tokenizer_name"}
# TRL's older names of its packing strategies (TRL renamed them): taken, said
PACKING_STRATEGIES = {"ffd": "bfd", "bfd-requeue": "bfd_split"}
# model_init_kwargs (TRL: from_pretrained's keyword arguments) that are settings here
INIT_KWARGS = {
    "torch_dtype": "dtype",
    "dtype": "dtype",
    "attn_implementation": "attn_implementation",
    "trust_remote_code": "trust_remote_code",
    "revision": "model_revision",
}

# TRL / handbook key -> what it is here. Keys spelled as TrainingArguments or our flags spell them are not listed.
TRL_NAMES = {
    "max_length, max_seq_length": "block_size (truncation length; with packing, the row length)",
    "dataset_text_field": "text_column",
    "dataset_num_proc": "preprocessing_num_workers",
    "dataset_config": "dataset_config_name (a local folder's README configs; refused with a train_file)",
    "dataset_train_split": "dataset_split (a local folder's or save_to_disk's splits; a train_file has train only)",
    "dataset_test_split": "dataset_test_split (evaluation data)",
    "torch_dtype": "dtype",
    "tokenizer_name_or_path": "tokenizer_name",
    "model_revision": "model_revision: hub model and tokenizer revision (said, and not read, for a local folder)",
    "model_init_kwargs": "its dtype/torch_dtype, attn_implementation, trust_remote_code and revision; others refused",
    "chat_template": "set on the tokenizer, used for chat data, saved with the model",
    "chat_template_path": "a .jinja file or a tokenizer folder whose template is set on the tokenizer",
    "auto_insert_empty_system_msg": "an empty system turn first where the template has one (dataset_mixer: true)",
    "eos_token": "the tokenizer's eos_token and the saved generation_config's eos_token_id",
    "warmup_ratio": "warmup_steps below 1 (transformers 5 reads it as a share of the run; said)",
    "evaluation_strategy, per_gpu_*, push_to_hub_model_id/token": "transformers 5's names (said)",
    "use_flash_attention_2": "attn_implementation: flash_attention_2 (said)",
    "accelerator_config, activation_checkpointing_kwargs, fsdp_config, gradient_checkpointing_kwargs, "
    "lr_scheduler_kwargs": "taken as mappings (as JSON text on the command line, or a JSON file for accelerator_config "
    "and fsdp_config), their keys checked; fsdp_config only with --fsdp",
    "bf16": "bf16 mixed precision, decided on a CPU as the configs' bf16 is (fp32 without native bf16)",
    "use_liger_kernel": "passed on with a CUDA GPU and liger-kernel; refused in one line without either",
    "dataset_mixture": "the handbook's mixture: id, config, split, columns, weight; seed, test_split_size",
    "dataset_mixer, dataset_splits, dataset_configs": "the handbook's older mixture (train/test splits by name)",
    "datasets, streaming, test_split_size": "TRL's mixture: path, name, data_dir, data_files, split, columns, fraction",
    "dataset_kwargs": "add_special_tokens false, append_concat_token, skip_prepare_dataset false; others refused",
    "packing": "false or unset: one example per row (truncated); true: packed without mixing documents",
    "packing_strategy": "bfd (ffd), bfd_split (bfd-requeue), wrapped (concat)",
    "assistant_only_loss": "chat data: true, loss on assistant tokens; false, on every token; unset: assistant's, said",
    "completion_only_loss": "false or unset; true (prompt-completion data) refused",
    "use_peft, lora_r, lora_alpha, lora_dropout, lora_target_modules": "LoRA with peft, the same meaning",
    "load_in_4bit, bnb_4bit_*, use_bnb_nested_quant": "QLoRA (CUDA and bitsandbytes only; refused elsewhere)",
}

# The alignment handbook's DEFAULT_CHAT_TEMPLATE (src/alignment/data.py, v0.3.0 and before), which its older
# dataset_mixer format's get_tokenizer set on a tokenizer without a chat template (its tests assert exactly that).
HANDBOOK_CHAT_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)

# keys whose null in TRL's or the handbook's dataclasses means the library's default: here, our default
NULL_IS_DEFAULT = ("torch_dtype", *MIXTURE_KEYS)
NULL_IS_DEFAULT += ("dataset_splits", "dataset_configs", "streaming", "test_split_size", "model_init_kwargs")

# TRL / handbook keys with no equivalent here: the values taken (TRL's defaults, or what this script does anyway),
# dropped without a word; any other value is refused by name with the reason (fsdp_recipes.config.trl_names).
NO_EQUIVALENT = {
    "dataset_streaming": ((False,), "datasets are loaded whole here, and cached by datasets"),
    "pad_token": ((None,), "the pad token is the tokenizer's (its EOS where it has none); padded labels are ignored"),
    "truncation_mode": (("keep_start",), "examples are truncated at the end here (TRL's keep_start)"),
    "shuffle_dataset": ((False,), "examples are prepared in the data's order; the Trainer's sampler shuffles them"),
    "padding_free": ((False,), "padding-free batches come with packing here: set packing: padding_free"),
    "pad_to_multiple_of": ((None,), "a batch is padded to its longest example"),
    "eval_packing": ((None,), "evaluation data is prepared as the training data is (TRL's eval_packing unset)"),
    "loss_type": ((None, "nll", "chunked_nll"), "the loss is the model's token-level cross-entropy (TRL's nll)"),
    "activation_offloading": (
        (False,),
        "the accelerate config's fsdp_offload_params offloads weights, not activations",
    ),
    "router_aux_loss_coef": ((0.001,), "a mixture-of-experts model's own config sets its router loss"),
    "lora_target_parameters": ((None,), "LoRA adapts the modules of lora_target_modules only"),
    "lora_modules_to_save": ((None,), "LoRA trains its adapters only: give use_peft false to train whole modules"),
    "lora_task_type": (("CAUSAL_LM",), "this script trains causal language models"),
    "use_rslora": ((False,), "LoRA here scales by alpha / r"),
    "use_dora": ((False,), "LoRA here is plain LoRA"),
    "ignore_bias_buffers": ((False,), "a DDP workaround; FSDP shards buffers itself"),
    "load_in_8bit": ((False,), "8-bit weights have no equivalent: QLoRA's load_in_4bit does"),
    # the handbook's older ModelArguments, DataArguments and SFTConfig
    "base_model_revision": ((None,), "a revision of a DPO base model; SFT reads model_revision"),
    "model_code_revision": ((None,), "model code is read at model_revision here"),
    "truncation_side": ((None, "right"), "examples are truncated at the end here"),
    "hub_model_revision": (("main",), "the upload goes to hub_revision, transformers 5's name"),
}


def translate(recipe: dict, argv: list[str] | None = None, tell=say) -> dict:
    """The recipe with its TRL and handbook keys as this script's settings; each change of name that TRL or
    transformers made is said once through ``tell``. ``argv``: the command line, whose --model_name_or_path
    replaces the recipe's."""
    out, notes = dict(recipe), []
    _renames(out, notes)
    for key, (taken, _) in NO_EQUIVALENT.items():
        if key in out and any(out[key] == v and type(out[key]) is type(v) for v in taken):
            out.pop(key)
    # TRL's and the handbook's null: the library's default, which ours is
    for key in NULL_IS_DEFAULT:
        if key in out and out[key] is None:
            out.pop(key)
    if out.get("packing_strategy") == "bfd" and out.get("packing") in (None, False, "false"):
        # TRL's default strategy, which TRL ignores without packing
        out.pop("packing_strategy")
    # as the JSON text a flag gives; dict_fields.check_dict_valued checks either
    for key in DICT_VALUED:
        if isinstance(out.get(key), dict):
            out[key] = json.dumps(out[key])
    _model_init_kwargs(out)
    _older_handbook_defaults(out, notes)
    if "dataset_mixture" in out and out.get("chat_template") is None and out.get("chat_template_path") is None:
        # the handbook's current sft.py, for a template-less tokenizer
        out.setdefault("default_chat_format", "chatml")
    _mixture(out, notes)
    _dataset_kwargs(out)
    if isinstance(out.get("packing_strategy"), str) and out["packing_strategy"] in PACKING_STRATEGIES:
        new = PACKING_STRATEGIES[out["packing_strategy"]]
        notes.append(f"packing_strategy {out['packing_strategy']} is TRL's older name of {new}: read as {new}")
        out["packing_strategy"] = new
    _local_sources(out, argv or [], notes)
    _chat_template_path(out)
    for note in notes:
        tell(note)
    return out


def translate_flags(argv: list[str], tell=say) -> list[str]:
    """The command line with transformers 4's names, the handbook's tokenizer_name_or_path and warmup_ratio under
    the names they have here (each said once, as in a recipe)."""
    out = []
    renamed = {**RENAMED, **HANDBOOK_ALIASES, "warmup_ratio": "warmup_steps"}
    skip = False
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        name = flag.removeprefix("--")
        if skip:
            skip = False
            continue
        given = value if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
        if flag.startswith("--") and name in NO_EQUIVALENT and given is not None and _taken(name, given):
            # a TRL flag at the value taken here (its default): dropped, as in a recipe
            skip = not eq
            continue
        if flag.startswith("--") and name in renamed:
            if name in RENAMED:
                tell(f"--{name} is transformers 4's name of --{renamed[name]}: read as --{renamed[name]}")
            elif name == "warmup_ratio":
                ratio = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
                try:
                    share = 0 <= float(ratio) < 1
                except ValueError:
                    share = False
                if not share:
                    raise RecipeError(f"--warmup_ratio {ratio}: give a share of the run from 0 up to (not) 1")
                tell("--warmup_ratio is --warmup_steps in transformers 5 (a value below 1 is a share of the run)")
            arg = f"--{renamed[name]}{eq}{value}"
        out.append(arg)
    return out


def _taken(name: str, given: str) -> bool:
    """Whether a flag's text is one of the values of NO_EQUIVALENT[name] taken here (false, none, a word)."""
    words = {"true": True, "false": False, "none": None, "null": None}
    for value in NO_EQUIVALENT[name][0]:
        if isinstance(value, str) and given == value:
            return True
        if not isinstance(value, str) and words.get(given.lower(), given) == value and given.lower() in words:
            return True
    return False


def _take(out: dict, old: str, new: str, value) -> None:
    """``old``'s value under ``new``; both given with different values is one line naming both."""
    if new in out and out[new] != value:
        raise RecipeError(
            f"recipe keys {old}: {out[old]!r} and {new}: {out[new]!r} are one setting with different values: keep one"
        )
    out.pop(old)
    out[new] = value


def _renames(out: dict, notes: list[str]) -> None:
    for old, new in RENAMED.items():
        if old in out:
            notes.append(f"{old} is transformers 4's name of {new}: read as {new}")
            _take(out, old, new, out[old])
    for old, new in HANDBOOK_ALIASES.items():
        if old in out:
            _take(out, old, new, out[old])
    if "warmup_ratio" in out:
        ratio = out["warmup_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise RecipeError(f"recipe key warmup_ratio: {ratio!r} is not a share of the run from 0 up to (not) 1")
        notes.append(
            f"warmup_ratio {ratio} is warmup_steps {ratio} in transformers 5 (a value below 1 is a share of the run)"
        )
        _take(out, "warmup_ratio", "warmup_steps", float(ratio))
    if "use_flash_attention_2" in out:
        if out["use_flash_attention_2"] is True:
            notes.append("use_flash_attention_2 is the handbook's older name of attn_implementation: flash_attention_2")
            _take(out, "use_flash_attention_2", "attn_implementation", "flash_attention_2")
        elif out["use_flash_attention_2"] is False:
            out.pop("use_flash_attention_2")
        else:
            raise RecipeError(
                f"recipe key use_flash_attention_2: {out['use_flash_attention_2']!r} is not true or false"
            )


def _model_init_kwargs(out: dict) -> None:
    """TRL's keyword arguments for from_pretrained: those that are settings here become them, the rest is refused."""
    kwargs = out.pop("model_init_kwargs", None)
    if kwargs is None:
        return
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as err:
            raise RecipeError(f"model_init_kwargs: {kwargs!r} is not a JSON mapping ({err})") from None
    if not isinstance(kwargs, dict):
        raise RecipeError(f"model_init_kwargs: {kwargs!r} is not a mapping of from_pretrained's keyword arguments")
    other = sorted(set(kwargs) - set(INIT_KWARGS))
    if other:
        raise RecipeError(
            f"model_init_kwargs {', '.join(other)}: no equivalent here (FSDP places and loads the weights; "
            f"only {', '.join(INIT_KWARGS)} are settings): remove them"
        )
    for key, value in kwargs.items():
        ours = INIT_KWARGS[key]
        if ours in out and out[ours] != value:
            raise RecipeError(
                f"model_init_kwargs {key}: {value!r} and {ours}: {out[ours]!r} are one setting with different "
                "values: keep one"
            )
        out[ours] = value


def _older_handbook_defaults(out: dict, notes: list[str]) -> None:
    """The handbook's older format (a dataset_mixer) with its own defaults where ours differ: an empty system turn
    inserted (its auto_insert_empty_system_msg, true), and its DEFAULT_CHAT_TEMPLATE for a tokenizer without one."""
    if out.get("dataset_mixer") is None:
        return
    if "auto_insert_empty_system_msg" not in out:
        out["auto_insert_empty_system_msg"] = True
        notes.append(
            "auto_insert_empty_system_msg is true in the handbook's dataset_mixer format (its default): an empty "
            "system turn begins each conversation without one, where the chat template has system turns; set it "
            "false to not"
        )
    if out.get("chat_template") is None and out.get("chat_template_path") is None:
        out.setdefault("default_chat_template", HANDBOOK_CHAT_TEMPLATE)


def _mixture(out: dict, notes: list[str]) -> None:
    plan = normalize_mixture(out)
    if plan is None:
        if out.get("streaming") is False:
            # TRL's default: nothing to stream
            out.pop("streaming")
        return
    for key in (*MIXTURE_KEYS, "dataset_splits", "dataset_configs", "streaming", "test_split_size"):
        out.pop(key, None)
    for key, default in (("dataset_train_split", "train"), ("dataset_split", "train"), ("dataset_test_split", "test")):
        if key in out and out.pop(key) != default:
            raise RecipeError(
                f"{key} picks a split of dataset_name; a mixture's splits are train (and test, with "
                f"test_split_size or the handbook's test splits): remove {key}"
            )
    for key in ("dataset_name", "dataset_config", "dataset_config_name"):
        if out.get(key) is not None:
            notes.append(f"{key} {out[key]!r} is not read: the dataset mixture gives the data (as TRL's sft.py does)")
        out.pop(key, None)
    out["dataset_mixture"] = json.dumps(plan)


def _dataset_kwargs(out: dict) -> None:
    """TRL's dataset_kwargs, as far as they mean something here (then dropped: they are what this script does)."""
    kwargs = out.pop("dataset_kwargs", None)
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise RecipeError(f"dataset_kwargs: {kwargs!r} is not a mapping")
    known = ("add_special_tokens", "append_concat_token", "skip_prepare_dataset")
    if other := sorted(set(kwargs) - set(known)):
        raise RecipeError(f"dataset_kwargs {', '.join(other)}: no equivalent here (known: {', '.join(known)})")
    if kwargs.get("skip_prepare_dataset"):
        raise RecipeError(
            "dataset_kwargs skip_prepare_dataset: true has no equivalent: the data is always tokenized here; remove it"
        )
    if kwargs.get("add_special_tokens"):
        raise RecipeError(
            "dataset_kwargs add_special_tokens: true has no equivalent: text is tokenized without the tokenizer's "
            "special tokens (an EOS ends each document) and chat data gets what its template writes; remove it"
        )
    concat = out.get("packing") == "concat" or out.get("packing_strategy") == "wrapped"
    if kwargs.get("append_concat_token") is False and concat:
        raise RecipeError(
            "dataset_kwargs append_concat_token: false with concatenated text (packing concat, or packing_strategy "
            "wrapped) has no equivalent: each document ends with EOS here; use packing: true, or remove it"
        )


def _flag(argv: list[str], name: str):
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def _local_sources(out: dict, argv: list[str], notes: list[str]) -> None:
    """model_revision for a local folder: said, and dropped (it names a revision of the hub, which a local folder does
    not have). A dataset split or configuration with a local source is DataArguments' to take or refuse
    (fsdp_recipes.config.local_datasets)."""
    model = _flag(argv, "model_name_or_path") or out.get("model_name_or_path")
    if "model_revision" in out and isinstance(model, str) and os.path.isdir(os.path.expanduser(model)):
        notes.append(
            f"model_revision {out['model_revision']!r} names a revision of a hub model: model_name_or_path "
            f"{model!r} is a local folder, read as it is"
        )
        out.pop("model_revision")


def _chat_template_path(out: dict) -> None:
    if out.get("chat_template") is not None and out.get("chat_template_path") is not None:
        raise RecipeError("chat_template and chat_template_path both give the chat template: keep one")
    path = out.get("chat_template_path")
    if isinstance(path, str) and path.endswith(".jinja") and not Path(path).expanduser().is_file():
        raise RecipeError(f"chat_template_path {path!r} does not exist: give a .jinja file or a tokenizer")
    local = Path(path).expanduser() if isinstance(path, str) else None
    if local is not None and local.exists() and not local.is_file():
        # a folder must be a tokenizer's; anything else that is not a regular file (a FIFO, a device) is refused
        if local.is_dir():
            problem = model_source_problem(path, weights=False)
        else:
            problem = f"is {file_kind(local.stat().st_mode)}"
        if problem:
            raise RecipeError(f"chat_template_path {path!r} {problem}: give a .jinja file or a tokenizer folder")
