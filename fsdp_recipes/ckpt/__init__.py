"""The checkpoint toolkit: what a checkpoint holds, whether it is complete, which one a run resumes, and the merge
of any FSDP checkpoint (ours, accelerate's, raw torch DCP, the stock Trainer's, Lightning's, peft's) into a Hugging
Face model folder (tools/merge_checkpoint.py, tools/check_checkpoint.py, and the training path's own export).

- layout:             file names, and the exact shapes of model and checkpoint folders (what may be replaced)
- torch_names:        torch's dtype, storage and DCP class names, known without importing torch
- dcp_layout:         a DCP folder's tensors, chunks and byte ranges as plain data; the errors that refuse a folder
- torch_save_archive: one torch.save record's zip archive, read as torch's own reader reads it
- dcp_pickles:        the one reader of a DCP folder's pickles, with allow-lists; guards torch's own DCP reader
- dcp_check:          is a DCP folder readable and safe: every file there, every chunk, every record vetted
- shard_digests:      which shard files a run wrote into its checkpoint, and which are no longer those
- readers, namespace, resolve: tensors from each format; stored names matched to a model's; which folder was meant
- status:             is a checkpoint complete and resumable (one verdict); which one a resume may use
- checkpoint_files:   each kind of file in a checkpoint judged (torch.save files, DCP folders, safetensors weights)
- rotation:           checkpoints set aside or rotated out (save_total_limit)
- stop_advice:        the line a stopped run closes with: how to go on, and a full disk
- model_match:        does a checkpoint belong to this run's model (shapes, config, LoRA settings, tokenizer)
- dtype_match:        would a resume round a checkpoint's weights or optimizer state (LoRA base included)
- resume:             which checkpoint a run resumes, what it sets aside or deletes (decided, never done, here)
- description:        the model a checkpoint holds (config, tokenizer, dtypes), recorded and checked
- lora_merge:         peft LoRA checkpoints merged as merge_and_unload does, or the adapter alone
- lora_input:         a LoRA checkpoint made a merge's input: merged weights, or the adapter folder
- base_identity:      which base a LoRA adapter was trained on, recorded, and checked on resume and merge
- hub_source:         a model named by path or hub id: paths that are not there, ids the hub refuses or never answers
- safetensors_writer, merge: the streamed conversion itself
- merge_output:       the folder a merge writes: what it may replace, and what a killed merge left beside it
- inspection:         what a checkpoint holds (nothing written), and a merged folder verified against it
- copier:             the conversion's byte copies, in a process of its own beside the merge's check

Imports no torch or transformers at import time (a subprocess test checks it): checking a checkpoint takes a
fraction of a second, and the merge pays for torch only where a format needs it. Never imports the training path.

May import: fsdp_recipes.errors, fsdp_recipes.console, fsdp_recipes.bounded, fsdp_recipes.removal, fsdp_recipes.tiny,
    fsdp_recipes.direct_writes, fsdp_recipes.compat
"""
