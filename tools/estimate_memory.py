"""Estimate per-GPU memory of FSDP (or DDP, ZeRO-1) training and list which shipped configs fit.

    python tools/estimate_memory.py 7B --nproc-per-node 4 --strategy FULL_SHARD
    python tools/estimate_memory.py assets/tiny-llama --config accelerate_configs/zero2.yaml --micro-batch 8 \
        --seq-len 128
    python tools/estimate_memory.py meta-llama/Llama-3.1-8B --nproc-per-node 8 --gpu-memory 80GiB --json

Formula (model states, mixed precision with fp32 master weights and Adam): 16 bytes per parameter P
(4 weights + 4 gradients + 8 Adam m and v) divided over the S processes that shard them: S = N for
FULL_SHARD and SHARD_GRAD_OP, S = processes per node for HYBRID_SHARD, S = 1 for NO_SHARD and DDP (16P/S);
ZeRO-1 (ddp.yaml --zero1 true) shards only Adam's 8 bytes: 8P + 8P/N.
Plus: 2 x the largest FSDP unit in bf16 (all-gather working set), 2P more for SHARD_GRAD_OP (gathered
parameters kept from forward to backward) and for DDP and ZeRO-1 in bf16 (autocast's bf16 weight copies, kept
as long), and activations: per token and layer, what a gated-MLP RMSNorm decoder (Llama family) saves for backward,
16h + 4q + 8I + 12kv + 4 heads bytes in bf16 (q and kv the query and key/value heads' widths, I the MLP's; more
for Qwen3's per-head norms; CPU-counted, and CUDA attention's copies measured on an H200), else GPT's 34h; 2h with
activation checkpointing; + the loss's peak over the logits, 12*s*b*V (three fp32 tensors as wide as the
vocabulary).
Gradients and activations do not peak together (backward frees one as it makes the other): the total counts the
larger. Every CUDA peak on record (bench/results/h200) is within 10% of it. With offload the model states move to CPU
RAM. FSDP1 in a shard group of one process (one process, or
HYBRID_SHARD with one per node) runs NO_SHARD whatever the config names, and is estimated so.
"""

import argparse
import json
import os
import re
import sys
from dataclasses import asdict

from fsdp_recipes.bounded import load_yaml
from fsdp_recipes.config.memory import (
    COUNT_LIKE,
    OPTIMIZER_BYTES,
    STRATEGIES,
    Setup,
    estimate,
    fitting_configs,
    human,
    model_shape,
    parse_bytes,
    parse_count,
)
from fsdp_recipes.config.strategy import FSDP1_HYBRID, strategy_of
from fsdp_recipes.console import OneLineParser, RawHelpFormatter
from fsdp_recipes.errors import bounded

# far above any real node, batch or sequence, and low enough that the formulas stay finite
MAX_COUNT = 2**31 - 1


def setup_from_config(path: str, setup: Setup) -> tuple[Setup, list[str]]:
    """Strategy and offload from an accelerate config (fsdp_recipes.config.strategy: FSDP1 strategy names, FSDP2
    reshard/mesh; a DDP config is DDP, or ZERO1 when --strategy ZERO1 asks for the recipe's zero1). Read within bounds
    (fsdp_recipes.bounded); a value of the wrong type is a ValueError that sends the user to tools/check_config.py,
    which names the key."""
    cfg = load_yaml(path, "accelerate config")
    # else accelerate's defaults (FSDP1 FULL_SHARD, fp32) pass as the file's
    if "distributed_type" not in cfg:
        raise ValueError(
            f"accelerate config {path!r} has no distributed_type: it is no accelerate config (a training recipe, or "
            "the torchrun route's fsdp_config?): give one such as accelerate_configs/zero3.yaml, or use --strategy"
        )
    fsdp, pc = cfg.get("fsdp_config") or {}, cfg.get("parallelism_config") or {}
    mp = cfg.get("mixed_precision", "no")
    try:
        if not (isinstance(fsdp, dict) and isinstance(pc, dict) and isinstance(mp, str)):
            raise ValueError("fsdp_config, parallelism_config or mixed_precision has the wrong type")
        strategy = strategy_of(cfg, zero1=setup.strategy == "ZERO1")
    # int() of a list, a word or .inf
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(
            f"accelerate config {path!r} has a value this tool cannot read ({err}): "
            f"python tools/check_config.py {path} names it"
        ) from None
    world = setup.nproc_per_node * setup.nnodes
    runs_as = strategy.memory_strategy_on(world, setup.nproc_per_node)
    notes = (
        [
            f"FSDP1 in a shard group of one process runs NO_SHARD, not the config's {strategy.memory_strategy} "
            "(torch switches)"
        ]
        if runs_as != strategy.memory_strategy
        else []
    )
    if strategy.name in FSDP1_HYBRID and strategy.fsdp_version == 1 and setup.nproc_per_node == 1 and world > 1:
        notes.append(
            f"train_fsdp.py refuses {strategy.name} with one process per node: torch would train every node alone"
        )
    return Setup(
        **{**asdict(setup), "strategy": runs_as, "offload": strategy.offload, "precision": {"no": "fp32"}.get(mp, mp)}
    ), notes


def whole_number(text: str) -> int:
    """argparse type of the counts (processes, nodes, batch, sequence): a whole number from 1 to MAX_COUNT."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to {MAX_COUNT}")
    return value


def size(text: str) -> str:
    """argparse type of --gpu-memory: checked here, kept as written (the report names it as given)."""
    try:
        parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


# a number with a letter or two after it ('7X', '13G', '1.5bn'): no hub id without an owner looks so, and no folder is
# named so here; a count with another suffix than K, M, B, T (a lookup would end in "couldn't connect to
# huggingface.co")
SUFFIXED_NUMBER = re.compile(r"\s*\d[\d.]*(e[-+]?\d+)?\s*([a-z]{1,2})\s*", re.IGNORECASE)


def model(text: str) -> str:
    """argparse type of the model: a text that looks like a parameter count must be a valid one."""
    if COUNT_LIKE.fullmatch(text):
        try:
            parse_count(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    elif (m := SUFFIXED_NUMBER.fullmatch(text)) and not os.path.exists(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count: its suffix {m.group(2)!r} is not K, M, B or T "
            "(e.g. 7B, 350M), and it is no folder or hub id (owner/name)"
        )
    return text


class Parser(OneLineParser):
    argv: list[str] = []

    def error(self, message):
        """argparse takes a model of '-7B' for an unknown option and then says the model is missing: the count's own
        problem is said instead."""
        negative = next((a for a in self.argv if a.startswith("-") and COUNT_LIKE.fullmatch(a)), None)
        if negative is not None and ("required: model" in message or "unrecognized arguments" in message):
            try:
                parse_count(negative)
            except ValueError as err:
                message = f"argument model: {err}"
        super().error(message)


def main(argv=None) -> int:
    parser = Parser(
        prog="estimate_memory.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=RawHelpFormatter,
    )
    parser.add_argument(
        "model", type=model, help="parameter count (7B, 350M; at most 100T), hub id, local folder or config.json"
    )
    parser.add_argument("--nproc-per-node", type=whole_number, default=8, help="processes (GPUs) per node")
    parser.add_argument("--nnodes", type=whole_number, default=1, help="nodes")
    parser.add_argument(
        "--strategy", choices=STRATEGIES, default="FULL_SHARD", help="FSDP sharding strategy, or DDP / ZERO1"
    )
    parser.add_argument("--config", help="an accelerate config: takes strategy, offload and precision from it")
    parser.add_argument("--offload", action="store_true", help="CPU offload of parameters, gradients and optimizer")
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="compute precision (master weights stay fp32)",
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_BYTES),
        default="adamw",
        help="optimizer, for its state bytes per parameter",
    )
    parser.add_argument("--micro-batch", type=whole_number, default=1, help="sequences per process per step")
    parser.add_argument("--seq-len", type=whole_number, default=2048, help="tokens per sequence")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="keep only each layer's input for the backward pass"
    )
    parser.add_argument(
        "--liger-kernel",
        action="store_true",
        help="use_liger_kernel: its fused cross-entropy never holds the logits (the estimate is then an upper bound)",
    )
    parser.add_argument(
        "--gpu-memory", type=size, help="e.g. 80GiB: list the shipped configs that fit, cheapest communication first"
    )
    parser.add_argument("--json", action="store_true", help="print the same as JSON")
    parser.argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        shape = model_shape(args.model)
        setup = Setup(
            args.strategy,
            args.nproc_per_node,
            args.nnodes,
            args.offload,
            args.precision,
            args.optimizer,
            args.micro_batch,
            args.seq_len,
            args.activation_checkpointing,
            args.liger_kernel,
        )
        notes = []
        if args.config:
            setup, notes = setup_from_config(args.config, setup)
        est = estimate(shape, setup)
        est.notes[:0] = notes
        fits = fitting_configs(shape, setup, parse_bytes(args.gpu_memory)) if args.gpu_memory else None
    except (ValueError, OSError) as err:
        print(bounded(f"estimate_memory.py: error: {err}"), file=sys.stderr)
        return 1
    if args.json:
        out = {"model": asdict(shape), "setup": asdict(setup), "per_gpu_bytes": est.as_dict()}
        if fits is not None:
            out["configs"] = [{"config": c, "gpu_bytes": b, "fits": f} for c, b, f in fits]
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{shape.params:,} parameters, {setup.strategy}{' + offload' if setup.offload else ''}, "
        f"{setup.nnodes} x {setup.nproc_per_node} processes (shard group {est.shard_group}), {setup.precision}, "
        f"{setup.optimizer}"
    )
    for label, value in [
        ("parameters (fp32 master)", est.params),
        ("gradients", est.grads),
        ("optimizer state", est.optimizer),
        ("model states (16P/S with Adam)", est.params + est.grads + est.optimizer),
        ("bf16 parameters held fwd->bwd", est.gathered_params),
        ("all-gather working set", est.all_gather_working_set),
        ("activations", est.activations),
        ("total per GPU", est.gpu_total),
    ]:
        print(f"  {label:<38}{human(value):>12}")
    print(f"  {'CPU RAM per node, offload':<38}{human(est.cpu_offload_per_node):>12}")
    print(f"  {'CPU RAM per node, loading (rank 0)':<38}{human(est.cpu_loading_per_node):>12}")
    print(f"  {'CPU RAM, tools/merge_checkpoint.py':<38}{human(est.cpu_merging):>12}")
    for note in est.notes:
        print(f"  note: {note}")
    if fits is not None:
        print(f"shipped configs on {args.gpu_memory} GPUs, cheapest communication first:")
        for config, need, ok in fits:
            print(f"  {'fits   ' if ok else 'too big'}  accelerate_configs/{config:<24}{human(need):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
