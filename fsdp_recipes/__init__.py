"""FSDP training recipes: the logic behind train_fsdp.py and tools/.

- arguments:     ModelArguments, DataArguments and recipe YAML + flag parsing
- data:          packed plain text or chat messages with assistant-only loss
- modeling:      model and tokenizer loading
- checks:        proof that the prepared model is FSDP-wrapped and sharded (fsdp_report.json)
- config_check:  accelerate config + recipe + model checks (tools/check_config.py, train_fsdp.py)
- export:        saving during training: self-describing checkpoints, the final model folder
- trainer:       FSDPTrainer: the Trainer plus FSDP checks and an exact FSDP1 optimizer resume
- checkpoints:   is a training checkpoint complete and resumable; which one a resume uses
- merge:         any FSDP checkpoint -> Hugging Face folder, streamed (tools/merge_checkpoint.py)
- dcp_files:     a DCP folder's tensors and byte ranges, read without importing torch (merge's fast path)
- memory:        the memory formulas (tools/estimate_memory.py)
- cpu_fsdp:      makes accelerate's FSDP path real on machines without an accelerator (tests, laptops)
- tiny:          the embedded default model, tokenizer and corpus
"""
