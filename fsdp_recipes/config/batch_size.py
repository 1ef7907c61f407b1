"""``per_device_train_batch_size: auto``: the largest micro-batch whose memory estimate fits the device, chosen before
the first step.

The estimate is fsdp_recipes.config.memory's (tools/estimate_memory.py), within 0.97-1.06 of every CUDA peak on
record (bench/results). A micro-batch fits when its estimate is at most (1 - MARGIN) of the device's memory: the
margin covers the estimate's own error, the CUDA context and what the caching allocator reserves beyond what it hands
out. On a GPU the device's memory is torch.cuda.mem_get_info's total (the card's, not what is free now: every rank
of a launch on one kind of card then chooses alike); without one, the host's memory divided over the node's
processes, and the line says so. accelerate's find_executable_batch_size only halves the batch after an
out-of-memory error; this chooses before anything is allocated.

The flag and the recipe key take ``auto`` (any case); parsing puts 1 in its place (``take_auto``) and the preflight
(fsdp_recipes.train.preflight.start) replaces it with the choice (``choose_for_run``), before run_args.json is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from fsdp_recipes.config.memory import ModelShape, Setup, estimate, human

KEY = "per_device_train_batch_size"
AUTO = "auto"
# of the device's memory left free: the estimate's error (up to +6%), CUDA's context, allocator slack
MARGIN = 0.10
# sequences: past this a step is long enough that a larger batch buys no speed, only a coarser run
MAX_AUTO_BATCH = 256


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def take_auto(recipe: dict, argv: list[str]) -> tuple[dict, list[str], bool]:
    """The recipe and flags with an ``auto`` per_device_train_batch_size replaced by 1 (the placeholder the checks
    see until the preflight chooses), and whether auto is in force: a flag wins over the recipe, as everywhere."""
    # HfArgumentParser's two
    flags, argv, auto = (f"--{KEY}", f"--{KEY.replace('_', '-')}"), list(argv), None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags and eq:
            auto = is_auto(value)
            argv[i] = f"{flag}=1" if auto else arg
        elif flag in flags and i + 1 < len(argv):
            auto = is_auto(argv[i + 1])
            argv[i + 1] = "1" if auto else argv[i + 1]
    if is_auto(recipe.get(KEY)):
        recipe = {**recipe, KEY: 1}
        auto = True if auto is None else auto
    return recipe, argv, bool(auto)


@dataclass
class Choice:
    # sequences per process per micro-batch
    batch: int
    # the estimate at that batch, bytes
    need: float
    # (1 - margin) x the device's memory, bytes
    budget: float
    # the estimate at batch + 1 (None: the cap stopped the search)
    next_need: float | None


def choose(
    shape: ModelShape, setup: Setup, device_bytes: float, margin: float = MARGIN, cap: int = MAX_AUTO_BATCH
) -> Choice:
    """The largest micro-batch from 1 to ``cap`` whose estimate is at most (1 - margin) x device_bytes. The estimate
    grows with the batch (activations are linear in tokens), so a binary search finds it. ValueError, naming what
    to change, when not even one sequence fits."""
    budget = (1 - margin) * device_bytes

    def need(batch: int) -> float:
        return estimate(shape, replace(setup, micro_batch=batch)).gpu_total

    if need(1) > budget:
        raise ValueError(
            f"{KEY} auto: not even 1 sequence of {setup.seq_len} tokens fits: it needs {human(need(1))} of the "
            f"{human(budget)} usable ({1 - margin:.0%} of {human(device_bytes)}); lower block_size, turn on "
            "activation_checkpointing, or shard over more processes (tools/estimate_memory.py --gpu-memory lists "
            "the configs that fit)"
        )
    # need(low) fits; find the largest that does
    low, high = 1, cap
    if need(high) <= budget:
        return Choice(high, need(high), budget, None)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if need(mid) <= budget else (low, mid)
    return Choice(low, need(low), budget, need(low + 1))


def setup_for_run(launch_config: dict | None, training_args, seq_len: int, zero1: bool = False) -> Setup:
    """The memory Setup of this launch: its strategy as it runs on this many processes (fsdp_recipes.config.strategy;
    without an accelerate config, e.g. TrainingArguments' --fsdp, the unsharded NO_SHARD: never more than fits),
    its precision, optimizer, sequence length and activation checkpointing."""
    from fsdp_recipes.config.strategy import strategy_of

    world = int(training_args.world_size)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    config = launch_config or {}
    if launch_config:
        strategy = strategy_of(launch_config, zero1=zero1)
        name, offload = strategy.memory_strategy_on(world, per_node), strategy.offload
    else:
        name, offload = "NO_SHARD", False
    mixed = str(config.get("mixed_precision") or "no").lower()
    precision = (
        "bf16" if training_args.bf16 or mixed == "bf16" else "fp16" if training_args.fp16 or mixed == "fp16" else "fp32"
    )
    optim = str(getattr(training_args.optim, "value", training_args.optim)).lower()
    optimizer = "adamw_8bit" if "8bit" in optim else "sgd_momentum" if optim.startswith("sgd") else "adamw"
    fsdp = config.get("fsdp_config") or {}
    checkpointing = bool(training_args.gradient_checkpointing) or str(
        fsdp.get("fsdp_activation_checkpointing", False)
    ).strip().lower() in ("true", "1", "yes")
    return Setup(
        strategy=name,
        nproc_per_node=per_node,
        nnodes=max(1, world // max(1, per_node)),
        offload=offload,
        precision=precision,
        optimizer=optimizer,
        micro_batch=1,
        seq_len=seq_len,
        activation_checkpointing=checkpointing,
    )


def liger_fuses_loss(model_type: str | None, training_args) -> bool:
    """Whether use_liger_kernel fuses this model's loss with its LM head, so the logits are never held whole: Liger
    has kernels for the family (its own table; a run with use_liger_kernel refuses where the package is missing) and
    liger_kernel_config leaves its fused cross-entropy on. GPT-2, say, has none: its logits are counted. With
    label smoothing the Trainer takes the labels from the model and smooths the full logits itself."""
    import inspect

    if not getattr(training_args, "use_liger_kernel", False) or getattr(training_args, "label_smoothing_factor", 0):
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return False
    if (apply := MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)) is None:
        return False
    # the family's own default (Granite's is off, Pixtral's apply function has no such kernel), unless configured
    fused = inspect.signature(apply).parameters.get("fused_linear_cross_entropy")
    config = getattr(training_args, "liger_kernel_config", None) or {}
    return fused is not None and bool(config.get("fused_linear_cross_entropy", fused.default))


def device_memory() -> tuple[float, str]:
    """(bytes, what they are): the GPU's total memory, or without one the host's divided over the node's
    processes."""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        return float(total), f"this GPU's {human(total)} ({torch.cuda.get_device_name()})"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
    return host / local, (
        f"{human(host / local)}, the host's {human(host)} over {local} process(es) (no GPU here: the estimate is "
        "of CUDA memory, on CPU a bound)"
    )


def describe(choice: Choice, setup: Setup, memory: str, cap: int = MAX_AUTO_BATCH) -> str:
    """The one line a run prints: what was chosen, from what, and what the next batch would need."""
    why = (
        f"{choice.batch + 1} would need {human(choice.next_need)}"
        if choice.next_need is not None
        else f"the cap of {cap} reached: auto chooses no larger batch"
    )
    return (
        f"{KEY} auto: {choice.batch} sequence(s) of {setup.seq_len} tokens, the largest whose estimate "
        f"({human(choice.need)}, {setup.strategy}{' + offload' if setup.offload else ''} on "
        f"{setup.nproc_per_node * setup.nnodes} process(es), tools/estimate_memory.py) fits {1 - MARGIN:.0%} of "
        f"{memory} ({why})"
    )


def with_examples(line: str, batch: int, examples: int, processes: int) -> str:
    """The auto line once the training set is built: a batch larger than each process's share of it is said (the
    cap on a CPU, or a tiny data set, picks one without a word otherwise); else the line as it is."""
    if examples >= batch * processes:
        return line
    return (
        f"{line}; the training set has {examples:,} example(s), fewer than {batch} x {processes} process(es): "
        "each micro-batch is a process's whole share of it"
    )


def choose_for_run(
    model: str,
    launch_config: dict | None,
    training_args,
    seq_len: int,
    zero1: bool = False,
    revision: str | None = None,
):
    """(batch, line) for this launch: the model's shape from its config (a hub id's at ``revision``; no weights read),
    the launch's Setup, the device's memory. ValueError (one line) when nothing fits."""
    from fsdp_recipes.config.memory import model_shape

    shape = model_shape(str(model), revision)
    fused = liger_fuses_loss(shape.model_type, training_args)
    setup = replace(setup_for_run(launch_config, training_args, seq_len, zero1), fused_loss=fused)
    device_bytes, memory = device_memory()
    choice = choose(shape, setup, device_bytes)
    return choice.batch, describe(choice, setup, memory)
