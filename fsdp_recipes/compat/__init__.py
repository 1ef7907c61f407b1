"""Where this repository reaches into other libraries: every patch of torch, accelerate or transformers, and the
registry of every private symbol the package touches (internals: a renamed one stops the run with one line naming
it and the pinned version). Nothing outside this package patches another library (tests/unit/test_layout.py).

- internals:           the registry, and the only way to get, patch or set a private symbol
- cpu_fsdp:            makes accelerate's FSDP (and DDP) real on machines without an accelerator
- torch_dcp:           torch's DCP reader made to vet what it unpickles (the vetting is fsdp_recipes.ckpt.dcp_pickles's)
- async_dcp:           accelerate's checkpoint saves through DCP with shard files written past the page cache, and in
                       the background (DCP's async_save from the live shards where they are in host memory, else
                       from one reused host copy)
- host_copy:           that host copy: made once (its buffers ahead, after the first optimizer step, on threads of
                       their own), filled at each checkpoint
- trainer_checkpoints: LoRA checkpoints under FSDP hold the adapter, every rank's slice (SHARDED), or the whole model
  (FULL)
- rank0_loading:       rank-0-only loading: FSDP2, rank 0 sends each rank its rows, not every weight whole; FSDP1,
                       the other ranks hold no weights until FSDP fills each unit
- peft_lora:           peft's get_peft_model without transformers' FutureWarning about a deprecated alias
- hub_deadline:        every huggingface_hub request with a deadline (HF_HUB_DOWNLOAD_TIMEOUT): none waits forever

May import: fsdp_recipes.errors, fsdp_recipes.console, fsdp_recipes.bounded, fsdp_recipes.removal, fsdp_recipes.tiny,
    fsdp_recipes.direct_writes
"""
