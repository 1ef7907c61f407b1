"""FSDP training recipes: the logic behind train_fsdp.py and tools/, in three products and a compatibility layer.

- config/:  what a run asks for, checked before anything starts (train_fsdp.py's arguments, tools/check_config.py,
            tools/estimate_memory.py)
- train/:   the training path (train_fsdp.py)
- ckpt/:    the checkpoint toolkit (tools/merge_checkpoint.py, tools/check_checkpoint.py; resume and export)
- compat/:  every patch of another library and the registry of the private symbols we touch

Shared by all of them, importing nothing else of the package but errors:

- errors:   the exception types (each carries a one-line message: the problem and the fix)
- console:  one-line messages printed once per launch
- bounded:  YAML and JSON read within bounds (no pipe, device, oversize file, alias bomb or duplicate key)
- removal:  the one place that deletes, replaces or moves anything, and only what this project made
- locks:    who holds a run's output_dir, read without taking it (train/run_lock.py takes it)
- direct_writes: large files written past the page cache (O_DIRECT) where the filesystem takes it
- tiny:     the embedded default: a tiny Llama config, tokenizer and corpus

Who may import whom is written in each subpackage's docstring ("May import:") and enforced by tests/unit/test_layout.py:
train -> config -> ckpt -> compat -> the shared modules, never the other way, and no import cycles.

May import: fsdp_recipes.errors
"""
