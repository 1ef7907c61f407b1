"""The run's own arguments (RunArguments), as a dataclass HfArgumentParser turns into flags: what the run may do to
its output_dir, a launch without FSDP, ZeRO-1 under DDP, checkpoints written in the background, the dtype of the
saved model, bf16 on CPUs without it. Each field is checked in ``__post_init__`` before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_recipes.config.arguments import DTYPES
from fsdp_recipes.config.rules import INF, Rule, check

# async_checkpoint_staging (fsdp_recipes.compat.host_copy.ReusedHostCopy)
STAGING = ("auto", "copy")


@dataclass
class RunArguments:
    _argument_group_name = "run"
    # rules.check, in __post_init__
    RULES = {
        "peak_tflops": Rule(
            0, INF, "give the GPU's dense bf16 peak in TFLOPS (989 for an H100 SXM), or leave it unset", low_open=True
        ),
    }
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train from scratch into an output_dir that holds another run: its checkpoint-N folders "
            "are deleted first."
        },
    )
    allow_no_fsdp: bool = field(
        default=False,
        metadata={
            "help": "Train without FSDP on purpose (debugging). A launch without an FSDP config is otherwise refused: "
            "`python train_fsdp.py` or `accelerate launch` with no config would train one unsharded model and exit 0."
        },
    )
    zero1: bool = field(
        default=False,
        metadata={
            "help": "ZeRO stage 1 under DDP (accelerate_configs/ddp.yaml): each of the N processes keeps 1/N of the "
            "optimizer state (torch's ZeroRedundancyOptimizer); parameters and gradients stay replicated. FSDP "
            "configs shard the optimizer state already."
        },
    )
    profile_steps: str | None = field(
        default=None,
        metadata={
            "help": "Profile these optimizer steps, e.g. 5-8: a Chrome trace per rank in output_dir/profile/ "
            "(and a CUDA memory snapshot on GPUs), and one line with the share of time in all-gather, "
            "reduce-scatter and all-reduce and how much of it overlapped compute."
        },
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "The GPU's dense bf16 peak in TFLOPS, for MFU in the logs (default: from a table of common "
            "GPUs, fsdp_recipes/train/metrics.py). MFU is not reported on CPU."
        },
    )
    save_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the final model folder's weights (and config.json's dtype). auto: the parameters' "
            "dtype as trained (--dtype; float32 master weights under bf16 mixed precision give float32). "
            "fsdp_report.json states it (precision.saved_model, export.dtype).",
            "choices": list(DTYPES),
        },
    )
    async_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "FSDP2 SHARDED_STATE_DICT: write checkpoint shards in the background while training goes on "
            "(from the live shards or a host copy: --async_checkpoint_staging; one at a time; complete once "
            "every rank wrote it). false: wait for each, as the stock Trainer does."
        },
    )
    async_checkpoint_staging: str = field(
        default="auto",
        metadata={
            "help": "What a background checkpoint writes from. auto: where every shard lives in host memory (CPU "
            "runs, CPU offload), straight from the live tensors, no copy, and the optimizer step after the "
            "checkpoint waits until its write is done (forward and backward never change them); elsewhere (GPU) "
            "from a host copy made at the first checkpoint and kept for the run. copy: always that host copy "
            "(as much host memory again as this rank's weight and optimizer shards; no optimizer step waits). "
            "Schedule-free optimizers, which change the weights outside their step, always get the copy; so must "
            "a callback of yours that changes weights or optimizer state in place (EMA swaps): pass copy.",
            "choices": list(STAGING),
        },
    )
    direct_io_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "Checkpoint shards written with O_DIRECT (past the page cache) where the filesystem takes "
            "it: same files, far less CPU. false: through the cache."
        },
    )
    cpu_bf16: bool = field(
        default=False,
        metadata={
            "help": "Keep bf16 mixed precision on a CPU without native bf16 instructions (x86 without avx512_bf16 "
            "or amx_bf16, Arm without bf16 in /proc/cpuinfo). Without it such a CPU computes in fp32 instead of "
            "the config's mixed_precision: bf16 (or bf16: true), many times faster there, and the run says so in "
            "one line and in fsdp_report.json (precision.cpu_bf16). GPUs and CPUs with native bf16 keep bf16 "
            "either way."
        },
    )

    def __post_init__(self):
        check(self)
