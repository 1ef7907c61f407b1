"""The training path behind train_fsdp.py, in the order a run meets it:

- run:        Run, the lifecycle train_fsdp.py calls: preflight, build, train, export, close
- exits:      every stop, error line and exit code of a run, decided in one place
- preflight:  carries out the Plan (fsdp_recipes.config.plan): patches for CPU, the process group, output_dir's lock
- run_lock:   one run per output_dir (a POSIX lock, or an O_EXCL lock file where the filesystem has none)
- data:       packed plain text, or chat messages with assistant-only loss; padding-free batches
- data_mixture: a recipe's dataset mixture, loaded, weighted and split with datasets' own calls
- chat_tokens: a recipe's chat template and end-of-turn token on the tokenizer and the generation config
- modeling:   the model and tokenizer, LoRA (peft) and QLoRA; a LoRA base built from a config, saved once
- optimizer:  the optimizer settings a resume would override; the dtypes a run holds; ZeRO-1's optimizer
- trainer:    FSDPTrainer: the Trainer plus the sharding proof, exact FSDP1/ZeRO-1 resumes, safe rotation
- sharding:   proof that the prepared model is FSDP-wrapped and sharded (fsdp_report.json)
- run_report: what the rest of the run adds to fsdp_report.json
- preemption: SIGTERM/SIGUSR1 save a checkpoint and stop cleanly
- async_checkpoints: checkpoints written in the background while training goes on
- metrics, profiling: throughput and MFU, the loss plot; a profiled step range
- export:     self-describing checkpoints, and the final export (save_final_model)
- export_parts: that export written by every rank in parallel, without a collective bounding its time
- model_folder: a checkpoint to output_dir/model/ (the merge's code), and the one way a model folder is published
- upload:     --push_to_hub: that folder (and a LoRA adapter) to the hub, once, after the run

May import: anything in fsdp_recipes
"""
