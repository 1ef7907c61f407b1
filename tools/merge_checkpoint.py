"""Merge an FSDP checkpoint into a Hugging Face model folder that from_pretrained loads.

    python tools/merge_checkpoint.py outputs/my-run/checkpoint-500 outputs/my-run-merged
    python tools/merge_checkpoint.py outputs/my-run outputs/my-run-merged      # newest complete checkpoint
    python tools/merge_checkpoint.py CKPT OUT --dtype bfloat16 --max-shard-size 5GB --verify
    python tools/merge_checkpoint.py CKPT --inspect                            # what is inside, no writing
"""

import argparse
import json
import os
import sys

from fsdp_recipes.merge import CheckpointError, inspect_checkpoint, merge_checkpoint

DTYPES = ("float32", "bfloat16", "float16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Merge a sharded (FSDP1/FSDP2 DCP, any number of ranks) or full FSDP checkpoint into a Hugging Face "
        "model folder: config.json, generation config, tokenizer and safetensors shards with an index. Cost: one read "
        "of the model weights and one write, at about disk speed; memory is bounded by --memory-budget and the largest "
        "tensor, not the model size. Optimizer state is skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("input", help="a checkpoint-N folder, its pytorch_model_fsdp_0 folder, or a run's output folder (newest complete checkpoint)")
    parser.add_argument("output", nargs="?", help="folder to create (written beside it first, renamed when complete)")
    parser.add_argument("--base-model", help="hub id or folder for config.json and tokenizer when the checkpoint has none")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep the saved dtype)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, as save_pretrained")
    parser.add_argument("--memory-budget", default="512MB", help="bytes of tensors read at once (a larger tensor is read alone)")
    parser.add_argument("--verify", action="store_true", help="re-read the output, compare every tensor with the checkpoint, load it on the meta device")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--inspect", action="store_true", help="print what the checkpoint holds and exit; writes nothing")
    args = parser.parse_args(argv)
    try:
        if args.inspect:
            print(json.dumps(inspect_checkpoint(args.input), indent=2))
            return 0
        if args.output is None:
            parser.error("OUTPUT is required unless --inspect is given")
        result = merge_checkpoint(
            args.input, args.output, base_model=args.base_model, dtype=args.dtype,
            max_shard_size=args.max_shard_size, memory_budget=args.memory_budget, overwrite=args.overwrite, verify=args.verify,
        )
    except CheckpointError as err:
        print(f"merge_checkpoint.py: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {result.output}: {result.tensors} tensors, {result.bytes / 1e6:.1f} MB in {', '.join(result.files)}")
    return 0


if __name__ == "__main__":
    code = main()
    # Every output file is closed and renamed by now. Tearing down an interpreter that has imported torch and
    # transformers takes about a second here (module and atexit cleanup that writes nothing): skip it, as
    # mypy does. Output streams are flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
