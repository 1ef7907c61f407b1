"""The model's arguments (ModelArguments), as a dataclass HfArgumentParser turns into flags: which model and
tokenizer, its dtype and attention kernel, remote code, and LoRA or QLoRA under TRL's ModelConfig names. Checked
in ``__post_init__`` before anything is loaded, with the probes of fsdp_recipes.config.model_source: a model folder
that cannot load, or would run code, is one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.config.arguments import DTYPES, trl_spellings
from fsdp_recipes.config.model_source import (
    config_size_problem,
    model_source_problem,
    one_line,
    qlora_problem,
    remote_code_problem,
)
from fsdp_recipes.config.rules import INF, Rule, check
from fsdp_recipes.errors import RecipeError


@dataclass
class ModelArguments:
    _argument_group_name = "model and LoRA (LoRA keys are TRL's ModelConfig names)"
    # rules.check, in __post_init__; the LoRA ones even without use_peft: such a value is a typo either way
    RULES = {
        "lora_r": Rule(1, INF, "give the LoRA rank, e.g. 16"),
        "lora_alpha": Rule(1, INF, "give a positive alpha, e.g. twice lora_r (the update is scaled by alpha / r)"),
        "lora_dropout": Rule(0, 1, "give a dropout probability below 1, e.g. 0.05", high_open=True),
    }
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub model id or local folder with weights to fine-tune. Leave unset to train from `config_name`."
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={
            "help": "Folder or config.json to build a model from scratch (random init) instead of loading weights."
        },
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
            "aliases": trl_spellings("dtype"),
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Attention kernel, e.g. sdpa, eager, flash_attention_2. Default: transformers' choice."},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub repository."})
    model_revision: str = field(
        default="main",
        metadata={
            "help": "TRL's: branch, tag or commit of a hub model (and its tokenizer); a local folder is read as it is."
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "The handbook's: a Jinja chat template set on the tokenizer, used for chat data and saved "
            "with the model."
        },
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "TRL's: a .jinja file, or a tokenizer folder, whose chat template is set on the tokenizer."},
    )
    default_chat_template: str | None = field(
        default=None,
        metadata={
            "help": "A chat template for a tokenizer that has none (the tokenizer's own, or chat_template, wins). The "
            "alignment handbook's older dataset_mixer format sets its DEFAULT_CHAT_TEMPLATE here, as its sft.py did."
        },
    )
    default_chat_format: str | None = field(
        default=None,
        metadata={
            "help": "chatml: for a tokenizer without a chat template, TRL's setup_chat_format (ChatML template, "
            "<|im_start|> and <|im_end|> as bos and eos, the embeddings grown for them). The alignment handbook's "
            "current dataset_mixture format sets it, as its sft.py does.",
            "choices": ["chatml"],
        },
    )
    eos_token: str | None = field(
        default=None,
        metadata={
            "help": "TRL's: the token ending a turn (e.g. <|im_end|>), set as the tokenizer's eos_token and as the "
            "saved generation_config's eos_token_id, so that generate() stops there. Must be in the vocabulary."
        },
    )
    # LoRA with peft, under the names TRL uses (trl.ModelConfig), so recipes carry over.
    use_peft: bool = field(
        default=False,
        metadata={
            "help": "Train a LoRA adapter (peft) instead of all weights, sharded by FSDP like the rest. The run ends "
            "with the merged model in output_dir/model/ and the adapter in output_dir/adapter/."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names to adapt, e.g. q_proj v_proj (default: every linear layer but the LM head)."},
    )

    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: load the base weights in 4 bits with bitsandbytes (CUDA only) and train a LoRA adapter "
            "(needs use_peft and model_name_or_path)."
        },
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit data type: nf4 or fp4.", "choices": ["nf4", "fp4"]}
    )
    bnb_4bit_compute_dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "dtype the 4-bit weights are dequantized to for compute.",
            "choices": ["bfloat16", "float16", "float32"],
        },
    )
    bnb_4bit_quant_storage: str = field(
        default="bfloat16",
        metadata={
            "help": "dtype the packed 4-bit weights are stored in. Under FSDP it must equal the dtype of the model's "
            "other parameters (dtype): FSDP shards all of a unit's parameters as one dtype.",
            "choices": ["bfloat16", "float16", "float32", "uint8"],
        },
    )
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Quantize the quantization constants too (double quantization)."}
    )

    def __post_init__(self):
        check(self)
        # argparse and YAML read "q_proj,v_proj" as one name, which peft then finds nowhere once the model is loaded
        if joined := next((m for m in self.lora_target_modules or () if "," in m), None):
            names = " ".join(n.strip() for n in joined.split(",") if n.strip())
            raise RecipeError(
                f"lora_target_modules={joined!r} is one name with commas in it: give the names apart, e.g. "
                f"--lora_target_modules {names} (in a recipe, a YAML list)"
            )
        if (self.model_name_or_path is None) == (self.config_name is None):
            raise RecipeError(
                "set exactly one of model_name_or_path (fine-tune weights) and config_name (train from scratch); "
                f"got model_name_or_path={self.model_name_or_path!r}, config_name={self.config_name!r}"
            )
        if self.load_in_4bit:
            if not (self.use_peft and self.model_name_or_path):
                raise RecipeError(
                    "load_in_4bit (QLoRA) quantizes pre-trained weights and trains a LoRA adapter on them: "
                    "set use_peft: true and model_name_or_path"
                )
            if problem := qlora_problem():
                raise RecipeError(problem)
        if self.config_name is not None and not Path(self.config_name).exists():
            raise RecipeError(f"config_name={self.config_name!r} does not exist: give a folder holding config.json")
        # the hub's checks look at it
        revision = None if self.model_revision == "main" else self.model_revision
        defaulted = self.tokenizer_name is None
        if defaulted:
            self.tokenizer_name = self.model_name_or_path or self.config_name
        for key, weights in (("model_name_or_path", True), ("tokenizer_name", False)):
            source = getattr(self, key)
            if source is not None and (problem := model_source_problem(source, weights, revision)):
                origin = (
                    f" (from {'model_name_or_path' if self.model_name_or_path else 'config_name'}: none was given)"
                    if key == "tokenizer_name" and defaulted
                    else ""
                )
                raise RecipeError(f"{key}={source!r}{origin} {problem}")
        # before anything loads: transformers would prompt (and on "y" run the folder's Python files) or fail
        # on every rank
        for key, tokenizer in (("model_name_or_path", False), ("config_name", False), ("tokenizer_name", True)):
            source = getattr(self, key)
            if source is not None and (
                problem := remote_code_problem(source, self.trust_remote_code, tokenizer, revision)
                or (not tokenizer and config_size_problem(source, revision))
            ):
                raise RecipeError(f"{key}={source!r} {one_line(problem)}")
