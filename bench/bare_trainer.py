"""The baseline for this repository's overhead: the same model and data through a bare accelerate + Trainer script.

    accelerate launch --config_file accelerate_configs/zero3.yaml bench/bare_trainer.py --config_name DIR \
        --tokenizer_name assets/tiny-llama --max_steps 20 --output_dir /tmp/bare

No recipe, no checks, no callbacks of ours (no sharding report, contract, manifest, preemption, throughput log),
no checkpoint and no final model: HfArgumentParser, a model built from a config, text packed into block_size
blocks, Trainer.train(). The one thing it shares with train_fsdp.py is fsdp_recipes.compat.cpu_fsdp, without which an
FSDP config on a machine without a GPU would not run FSDP at all (it does nothing where a GPU exists; on a CPU
without native bf16 it makes both compute in fp32), and bench/step_times.py, which records step times the same
way in both. bench/scaling.py runs it beside train_fsdp.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.compat import cpu_fsdp

REPO = Path(__file__).resolve().parent.parent


@dataclass
class BareArguments:
    config_name: str = field(metadata={"help": "folder with the model's config.json"})
    tokenizer_name: str = field(
        default=str(REPO / "assets" / "tiny-llama"), metadata={"help": "folder of the tokenizer"}
    )
    train_file: str = field(
        default=str(REPO / "assets" / "data" / "tiny_corpus.txt"), metadata={"help": "text file, one document per line"}
    )
    block_size: int = field(default=128, metadata={"help": "tokens per packed block"})


def main() -> None:
    # before TrainingArguments creates accelerate's state
    if not cpu_fsdp.enable():
        cpu_fsdp.enable_ddp()
    # fp32 on a CPU without native bf16, as train_fsdp.py (a fair baseline)
    cpu_fsdp.choose_cpu_precision(False, False)
    from datasets import load_dataset
    from step_times import StepTimes
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        HfArgumentParser,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    bare, args = HfArgumentParser((BareArguments, TrainingArguments)).parse_args_into_dataclasses()
    args.report_to, args.save_strategy = [], "no"
    tokenizer = AutoTokenizer.from_pretrained(bare.tokenizer_name)
    text = load_dataset("text", data_files=bare.train_file, split="train")
    ids = text.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

    def pack(batch):
        flat = [t for doc in batch["input_ids"] for t in doc + [tokenizer.eos_token_id]]
        blocks = [flat[i : i + bare.block_size] for i in range(0, len(flat) - bare.block_size + 1, bare.block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    train = ids.map(pack, batched=True, remove_columns=ids.column_names)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bare.config_name))
    trainer = Trainer(
        model=model, args=args, train_dataset=train, data_collator=default_data_collator, callbacks=[StepTimes()]
    )
    trainer.train()
    # Without it gloo's worker threads meet interpreter teardown: now and then SIGABRT ("terminate called without
    # an active exception", pytorch/pytorch#190489) after a run that succeeded. accelerate does it on end_training.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
    # end_training alone still let that abort through (a README command's run, 2026-11-26): leave as train_fsdp.py
    # does, without the interpreter's teardown, once the output is flushed (the same for both sides of the benchmark)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
