"""The config tools: what a run asks for, checked before anything starts, and what it will cost.

- parse:             ``train_fsdp.py [recipe.yaml] [--flag value ...]`` -> the argument dataclasses and a Plan
- arguments:         DataArguments, and what the argument dataclasses share (TRL's spellings, build)
- model_arguments:   ModelArguments: the model, its tokenizer, dtype and LoRA (TrainingArguments is transformers')
- run_arguments:     RunArguments: what the run may do to its output_dir, how it checkpoints and saves
- trl_names, trl_recipe, mixture: TRL's and the handbook's recipe keys with TRL's meaning; dataset mixtures
- helptext:          the script's --help in groups, --help-all for the rest of TrainingArguments
- rules:             what each field of the argument dataclasses accepts, declared beside it, checked in one pass
- values:            TrainingArguments' ranges, and the checks that need several values at once
- flags:             argparse reads the flags, and converts recipe values, each refusal one line
- hub_push:          --push_to_hub: where the final model goes, and what stops the upload, found before training
- packages:          options that need a package (--optim, --report_to, --attn_implementation, liger): named if missing
- model_source, data_files: is the model loadable (and runs no code of its folder), is the data file usable, found
  without loading either
- local_datasets:    the splits and configurations a local data source has, for dataset_split and dataset_config
- dict_fields:       TrainingArguments' dict | str fields (accelerator_config, ...): each form read, its keys checked
- trainer_fsdp:      the torchrun route (TrainingArguments' --fsdp_config), checked against the keys it reads
- plan:              the Plan: what the checks decided, carried out by fsdp_recipes.train.preflight
- accelerate_config: the rules of tools/check_config.py for accelerate config files
- problems:          a problem of a config (file, key, what, fix), and the checker that collects them
- fsdp_section:      the rules of a config's fsdp_config section alone
- recipe_checks:     a config against the recipe beside it and the model it trains
- launcher:          the settings of this launch (accelerate launch's flags and file, or FSDP_* variables)
- strategy:          the one mapping from an accelerate config to a sharding strategy
- memory:            the memory model behind tools/estimate_memory.py
- batch_size:        per_device_train_batch_size: auto, the largest micro-batch the memory model fits on the device

Nothing here joins a process group, moves a file or loads a model: bad input fails in seconds on every rank.

May import: fsdp_recipes.errors, fsdp_recipes.console, fsdp_recipes.bounded, fsdp_recipes.removal, fsdp_recipes.tiny,
    fsdp_recipes.compat, fsdp_recipes.ckpt
"""
