"""Merge an FSDP checkpoint into a Hugging Face model folder that from_pretrained loads.

    python tools/merge_checkpoint.py outputs/my-run/checkpoint-500 outputs/my-run-merged
    python tools/merge_checkpoint.py outputs/my-run outputs/my-run-merged      # newest complete checkpoint
    python tools/merge_checkpoint.py CKPT OUT --dtype bfloat16 --max-shard-size 5GB --verify
    python tools/merge_checkpoint.py CKPT --inspect                            # what is inside, no writing
    python tools/merge_checkpoint.py lightning.ckpt OUT --base-model BASE      # another tool's checkpoint
    python tools/merge_checkpoint.py PEFT_CKPT OUT --adapter-only              # a LoRA run: the adapter alone
    python tools/merge_checkpoint.py PEFT_CKPT OUT --base-model BASE           # adapter-only checkpoint + its base

Checkpoints from other tools are accepted: raw torch DCP (flat names), torch's get_state_dict beside its
optimizer, accelerate and the stock Trainer, Lightning, PEFT LoRA (merged, or --adapter-only). The weights
are found by matching stored names and shapes against the model built from config.json (from the checkpoint,
its parent, or --base-model); --inspect says which layout was recognised. The tokenizer is copied when present.
A LoRA checkpoint of train_fsdp.py holds the adapter alone: the merge reads the frozen base's weights from
--base-model, else from the folder its adapter_config.json names (base_model_name_or_path).
"""

import argparse
import json
import os
import signal
import sys

from fsdp_recipes.ckpt.inspection import inspect_checkpoint
from fsdp_recipes.ckpt.merge import merge_checkpoint
from fsdp_recipes.compat import internals
from fsdp_recipes.console import HelpFormatter, OneLineParser
from fsdp_recipes.errors import CheckpointError, InternalsChanged, RefusedRemoval, bounded
from fsdp_recipes.removal import identity

DTYPES = ("float32", "bfloat16", "float16")
# The smallest sizes taken, in bytes as huggingface_hub reads "100KB" and "64MB" (decimal units). A shard limit
# below 100KB gives nearly every tensor of any real model a file of its own, which is a slip, not a choice (the
# tiny test models shard at 200KB). The merge process holds torch and transformers, some hundreds of MB, whatever
# the budget: below 64MB a budget saves nothing and only reads the tensors one by one.
MIN_SHARD_SIZE, MIN_MEMORY_BUDGET = ("100KB", 100_000), ("64MB", 64_000_000)


class Stopped(BaseException):
    """SIGTERM (a scheduler's stop, `timeout`, `kill`) during a merge: unwinds as Ctrl-C does, so the merge removes its
    staging folder and stops its copy process (without it the process died at once and left both until the next
    merge)."""


# the signals that stopped this merge: one Python swallowed is a stop all the same
STOPS: list[int] = []


def _stopped(signum, frame):
    # One stop: a second of either kind would cut the merge's cleanup short (SIGKILL still ends it). The signal is
    # recorded before it is raised: a handler run inside a finalizer or weakref callback has its exception printed
    # and dropped by Python, and the merge would otherwise go on as if never stopped.
    for each in (signal.SIGTERM, signal.SIGINT):
        signal.signal(each, signal.SIG_IGN)
    STOPS.append(signum)
    raise KeyboardInterrupt if signum == signal.SIGINT else Stopped


def size_type(parse_size, example: str, minimum: tuple[str, int]):
    """argparse type of a size option: bytes as huggingface_hub's parse_size_to_int reads them ("5GB", "512MB"),
    finite and at least ``minimum``; anything else is one line naming the value and what to give."""
    shown, least = minimum

    def size(text: str) -> int:
        # '5': bytes? megabytes? save_pretrained wants a unit too
        if text.strip()[-2:].upper() not in ("KB", "MB", "GB", "TB"):
            raise argparse.ArgumentTypeError(
                f"{text!r} has no unit: give a number and a unit (KB, MB, GB or TB), e.g. {example}"
            )
        try:
            value = parse_size(text)
        # 'nanGB' (int() of NaN), 'infGB' and '1e400GB' (of infinity), 'fiveGB'
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a finite size: give a number and a unit (KB, MB, GB or TB), e.g. {example}"
            ) from None
        if value < least:
            raise argparse.ArgumentTypeError(
                f"{text!r} is {'not positive' if value <= 0 else f'below {shown}'}: give at least {shown}, e.g. "
                f"{example}"
            )
        return value

    return size


def main(argv=None) -> int:
    # the private parser of "5GB": a renamed one is one line here, not a traceback from argparse
    try:
        parse_size = internals.get("huggingface_hub.serialization._base.parse_size_to_int")
    except InternalsChanged as err:
        print(bounded(f"merge_checkpoint.py: error: {err}"), file=sys.stderr)
        return 1
    parser = OneLineParser(
        prog="merge_checkpoint.py",
        description="Merge a sharded (FSDP1/FSDP2 DCP, any number of ranks) or full FSDP checkpoint into a "
        "Hugging Face "
        "model folder: config.json, generation config, tokenizer and safetensors shards with an index. Cost: one read "
        "of the model weights and one write, at about disk speed; memory is bounded by --memory-budget and the largest "
        "tensor, not the model size. Optimizer state is skipped. Accepts checkpoints of this repository, "
        "accelerate, the "
        "Trainer, raw torch DCP, Lightning and PEFT LoRA (merged into the base weights, or --adapter-only).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "input",
        help="a checkpoint-N folder, a DCP folder (pytorch_model_fsdp_0, raw torch, Lightning), or a run's "
        "output folder (newest complete checkpoint)",
    )
    parser.add_argument("output", nargs="?", help="folder to create (written beside it first, renamed when complete)")
    parser.add_argument(
        "--base-model",
        help="hub id or folder for config.json (and tokenizer) when the checkpoint has none; a folder with "
        "only config.json is enough. "
        "For an adapter-only LoRA checkpoint, also the base weights: a local model folder (or a hub id in the "
        "local cache); "
        "default: the base its adapter_config.json names",
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="PEFT LoRA checkpoint: write the adapter folder (adapter_config.json, adapter_model.safetensors) "
        "instead of the merged model",
    )
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep the saved dtype)")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        type=size_type(parse_size, "5GB", MIN_SHARD_SIZE),
        help=f"largest safetensors file, as save_pretrained (at least {MIN_SHARD_SIZE[0]})",
    )
    parser.add_argument(
        "--memory-budget",
        default="512MB",
        type=size_type(parse_size, "512MB", MIN_MEMORY_BUDGET),
        help=f"bytes of tensors read at once (a larger tensor is read alone; at least {MIN_MEMORY_BUDGET[0]})",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-read the output, compare every tensor with the checkpoint, load it on the meta device",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument(
        "--inspect", action="store_true", help="print what the checkpoint holds and exit; writes nothing"
    )
    args = parser.parse_args(argv)
    if args.output is None and not args.inspect:
        parser.error("OUTPUT is required unless --inspect is given")
    # a stop after the rename into place: told apart
    earlier = None if args.output is None else identity(args.output)
    # A signal's handler runs at whichever call comes next, so a stop is caught wherever it lands while the handlers
    # are in place, the calls that put them in place and hand the caller's back included. The stop is said with the
    # caller's handlers back.
    STOPS.clear()
    before = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            before[signum] = signal.signal(signum, _stopped)
        code = _merge(args)
    # the staging folder and the copy process are gone (merge's cleanup)
    except KeyboardInterrupt:
        # recorded already, or a Ctrl-C before the handler was in place
        STOPS.append(signal.SIGINT)
    except Stopped:
        pass
    finally:
        try:
            _hand_back(before)
        # recorded; the handlers ignore any further stop until handed back
        except (KeyboardInterrupt, Stopped):
            _hand_back(before)
    if not STOPS:
        return code
    interrupted = STOPS[0] == signal.SIGINT
    what = "interrupted" if interrupted else "stopped by SIGTERM"
    # after the rename into place
    if args.output is not None and identity(args.output) not in (earlier, None):
        print(
            f"merge_checkpoint.py: {what} after {args.output} was written whole and moved into place", file=sys.stderr
        )
    else:
        print(f"merge_checkpoint.py: {what}: nothing was published", file=sys.stderr)
    return 130 if interrupted else 128 + signal.SIGTERM


def _hand_back(before: dict) -> None:
    for signum, handler in reversed(before.items()):
        signal.signal(signum, handler)


def _merge(args: argparse.Namespace) -> int:
    """The merge (or --inspect) the arguments ask for, its outcome printed; returns the exit code."""
    try:
        if args.inspect:
            print(json.dumps(inspect_checkpoint(args.input), indent=2))
            return 0
        result = merge_checkpoint(
            args.input,
            args.output,
            base_model=args.base_model,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            memory_budget=args.memory_budget,
            overwrite=args.overwrite,
            verify=args.verify,
            adapter_only=args.adapter_only,
        )
    except (CheckpointError, InternalsChanged, RefusedRemoval) as err:
        print(bounded(f"merge_checkpoint.py: error: {err}"), file=sys.stderr)
        return 1
    # disk full, permission denied ...: nothing was left behind (the staging folder is removed)
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        print(
            bounded(
                f"merge_checkpoint.py: error: {err.strerror or err}{where}: nothing was written; fix it and run again"
            ),
            file=sys.stderr,
        )
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
