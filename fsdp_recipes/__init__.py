"""FSDP training recipes: the logic behind train_fsdp.py and tools/.

- cpu_fsdp:   makes accelerate's FSDP path real on machines without an accelerator (tests, laptops)
- arguments:  ModelArguments, DataArguments and recipe YAML + flag parsing
- data:       packed plain text or chat messages with assistant-only loss
- modeling:   model and tokenizer loading
- checks:     proof that the prepared model is FSDP-wrapped and sharded
- export:     sharded (DCP) checkpoint -> Hugging Face model folder
- tiny:       the embedded default model, tokenizer and corpus
"""
