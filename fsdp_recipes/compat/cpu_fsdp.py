"""Make accelerate's FSDP path real on a machine without an accelerator.

Why this exists: with accelerate 1.15 every stock way of launching FSDP on a CPU-only machine silently
runs something else (DistributedType.NO, MULTI_CPU + DDP, or one process) and exits 0, because
``AcceleratorState`` only switches to FSDP when the base type is an accelerator type. That would make
every CPU test of this repository test DDP or nothing (docs/cpu.md).

What :func:`enable` does, only when no accelerator is present and FSDP is asked for across several
processes, by the accelerate launcher (``ACCELERATE_USE_FSDP=true``) or by TrainingArguments' ``--fsdp``
under torchrun (``fsdp_recipes.train.preflight.start`` calls it just before TrainingArguments exists):

1. sets ``ACCELERATE_USE_CPU=true`` so the process group is gloo (MULTI_CPU), then turns MULTI_CPU into
   FSDP inside ``AcceleratorState`` and mirrors the type into ``PartialState``'s shared state (later
   ``AcceleratorState()`` calls would otherwise copy MULTI_CPU back);
2. uses ``torch.device("cpu")`` as the device: FSDP1 rejects ``cpu:0`` ("Inconsistent compute device
   and device_id") and ``None`` ("FSDP needs a non-CPU accelerator device");
3. gives the FSDP plugin a CPU ``param_init_fn`` where its post-init raises "no available devices"
   (sync_module_states / cpu_ram_efficient_loading);
4. skips FSDP1's "module has CPU parameters or buffers when sync_module_states=True" check: the gloo
   broadcast itself works;
5. makes ``Tensor.pin_memory`` a no-op (it raises without an accelerator) and gives ``torch.cpu.Stream``
   the ``synchronize`` FSDP1 calls when offloading;
6. makes FSDP1's ``FlatParamHandle.to_cpu`` a no-op: with ``offload_to_cpu`` (FULL_STATE_DICT, which
   accelerate's ``save_fsdp_model`` forces on) it "moves" the parameter to the CPU it is already on, then
   frees that same storage, and rank 0 segfaults.

And :func:`apply_ddp_timeout`, called once the process group exists: transformers 5.23 gives accelerate's
``PartialState`` no ``timeout`` when ``ACCELERATE_USE_CPU`` is set (item 1, and :func:`enable_ddp`), so over gloo
every collective waited torch's 30 minutes whatever ``--ddp_timeout`` said. It sets the run's timeout on the
default process group, as the GPU path gets it.

And :func:`choose_cpu_precision`, called before TrainingArguments exists on every launch route: bf16 mixed precision
(the shipped configs' ``mixed_precision: bf16``, or TrainingArguments' ``bf16: true``) on a machine without an
accelerator whose CPU lacks native bf16 instructions (x86 without avx512_bf16 or amx_bf16 in /proc/cpuinfo's
"flags", Arm without bf16 in its "Features") computes in fp32 instead: there a bf16 matmul runs about 50x slower
than fp32 (torch 2.13 on a 2-core AMD EPYC with AVX2: 0.37 against 18 GFLOP/s for 1024x1024). It says so in one line
and in fsdp_report.json (``precision.cpu_bf16``); ``--cpu_bf16 true`` (RunArguments) keeps bf16 there anyway. A CPU
with native bf16, one whose instructions cannot be read, and every accelerator keep bf16 exactly as asked.
``torch.backends.cpu.get_cpu_capability()`` cannot tell: it says AVX512 with and without avx512_bf16.

These patch private internals of the exact versions pinned in requirements.txt, each named in
fsdp_recipes/compat/internals.py and checked before anything is patched. Nothing here runs when an accelerator exists:
there, the stock path is already real FSDP.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

from fsdp_recipes.compat import internals
from fsdp_recipes.errors import RecipeError

_ENABLED = False
CPU = torch.device("cpu")


def accelerator_present() -> bool:
    """True when torch sees any accelerator (CUDA, XPU, MPS, ...): the stock FSDP path works there."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def fsdp_requested(env=None) -> bool:
    """FSDP asked for by the launcher: ACCELERATE_USE_FSDP=true in ``env`` (this process's environment when None),
    set by accelerate launch from an FSDP config, or by hand under torchrun or srun. The one place it is read."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def needed(trainer_fsdp: bool = False) -> bool:
    """The patch applies to a multi-process FSDP launch on a machine with no accelerator. FSDP is asked for
    by the accelerate launcher's config, or (the torchrun route) by TrainingArguments' ``--fsdp``."""
    return (fsdp_requested() or trainer_fsdp) and not accelerator_present() and launched_world_size() > 1


def enable_ddp(trainer_fsdp: bool = False) -> bool:
    """A multi-process launch without FSDP (accelerate_configs/ddp.yaml) on a machine with no accelerator: accelerate
    1.15 makes each rank DistributedType.NO there, N unconnected runs that each train alone. ACCELERATE_USE_CPU
    makes it MULTI_CPU, DistributedDataParallel over gloo. Patches nothing. Returns whether it applied."""
    if fsdp_requested() or trainer_fsdp or accelerator_present() or launched_world_size() < 2:
        return False
    os.environ["ACCELERATE_USE_CPU"] = "true"
    return True


def single_process_problem(trainer_fsdp: bool = False) -> str | None:
    """FSDP asked for on one process without an accelerator would silently train an unwrapped model."""
    if (fsdp_requested() or trainer_fsdp) and not accelerator_present() and launched_world_size() < 2:
        return (
            "FSDP is asked for, but without a GPU FSDP runs over gloo and needs 2 or more processes; this "
            "launch has 1: "
            "pass --num_processes 2 (or more) to accelerate launch, or --nproc_per_node 2 to torchrun"
        )
    return None


def enable(trainer_fsdp: bool = False) -> bool:
    """Apply the patches if :func:`needed`; return whether they are active. Idempotent.

    Call it before ``TrainingArguments`` (or anything else) creates accelerate's ``PartialState``.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if not needed(trainer_fsdp):
        return False
    # all or nothing: a half-patched run would be wrong without a word
    internals.require(*CPU_PRIVATE)
    os.environ["ACCELERATE_USE_CPU"] = "true"
    _patch_accelerator_state()
    _patch_fsdp_plugin()
    _patch_fsdp1_internals()
    _ENABLED = True
    return True


def cpu_devices_per_node() -> int:
    """What FSDP1 HYBRID_SHARD takes for a node's device count on CPU once patched: the node's processes."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


CPU_PRIVATE = (
    "torch.distributed.fsdp._init_utils._init_intra_and_inter_node_groups",
    "accelerate.state.AcceleratorState._shared_state",
    "accelerate.state.PartialState._shared_state",
    "torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states",
    "torch.distributed.fsdp._flat_param.FlatParamHandle.to_cpu",
)


def apply_ddp_timeout(seconds: float) -> bool:
    """``--ddp_timeout`` on the default gloo process group of a CPU run (see the module docstring); returns whether
    it was set. Nothing where an accelerator is present (transformers passes the timeout there) or without a group."""
    import datetime

    import torch.distributed as dist

    if accelerator_present() or not (dist.is_available() and dist.is_initialized()):
        return False
    internals.get("torch.distributed.distributed_c10d._set_pg_timeout")(datetime.timedelta(seconds=seconds))
    return True


def is_enabled() -> bool:
    return _ENABLED


def _patch_accelerator_state() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        accelerator_shared = internals.get("accelerate.state.AcceleratorState._shared_state")
        partial_shared = internals.get("accelerate.state.PartialState._shared_state")
        was_initialized = accelerator_shared != {} and accelerator_shared != partial_shared
        original_init(self, *args, **kwargs)
        if was_initialized or self.distributed_type != DistributedType.MULTI_CPU:
            return
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None:
            return
        self.distributed_type = DistributedType.FSDP
        mixed_precision = internals.attr(self, "accelerate.state.AcceleratorState._mixed_precision")
        if mixed_precision != "no":
            plugin.set_mixed_precision(mixed_precision)
        self.fsdp_plugin = plugin
        self.device = CPU
        partial_shared["distributed_type"] = DistributedType.FSDP
        partial_shared["device"] = CPU

    AcceleratorState.__init__ = init


def _patch_fsdp_plugin() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    original_post_init = FullyShardedDataParallelPlugin.__post_init__

    @functools.wraps(original_post_init)
    def post_init(self):
        try:
            original_post_init(self)
        except RuntimeError as err:
            # Raised at the very end of post-init, after every other field is set, when
            # sync_module_states asks for an accelerator to materialise meta tensors on.
            if "no available devices" not in str(err):
                raise
            self.param_init_fn = lambda module: module.to_empty(device=CPU, recurse=False)

    FullyShardedDataParallelPlugin.__post_init__ = post_init


def _patch_fsdp1_internals() -> None:
    import contextlib

    internals.patch(
        "torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states", lambda module_states: None
    )
    internals.patch(
        "torch.distributed.fsdp._flat_param.FlatParamHandle.to_cpu", contextlib.contextmanager(lambda self: (yield))
    )
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    # HYBRID_SHARD's "node" is as many ranks as a process sees devices: 1 on CPU, so every process was a node of
    # one, switched to NO_SHARD, and no gradient crossed processes (the ranks trained apart). Here a node's devices
    # are its processes, so HYBRID_SHARD shards within the node and replicates across nodes as on GPUs.
    node_groups = internals.get("torch.distributed.fsdp._init_utils._init_intra_and_inter_node_groups")
    internals.patch(
        "torch.distributed.fsdp._init_utils._init_intra_and_inter_node_groups",
        lambda global_group, num_devices_per_node: node_groups(global_group, cpu_devices_per_node()),
    )
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


# /proc/cpuinfo's names of the instructions that compute bf16 natively: x86 lists them under "flags", Arm under
# "Features". Without them torch 2.13 computes bf16 through fp32 conversions, far slower than fp32 itself.
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FEATURE = "bf16"
CPU_BF16_SWITCH = "--cpu_bf16 true"
CPUINFO = "/proc/cpuinfo"


def _instruction_sets(cpuinfo: str) -> tuple[str, list[str]] | None:
    """("flags", [...]) on x86, ("Features", [...]) on Arm: the first processor's line (the cores of one machine share
    their instruction sets); None when the text has neither (another architecture, or no such file)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return key.strip(), value.split()
    return None


def native_bf16(cpuinfo: str) -> bool | None:
    """Whether the CPU described by ``cpuinfo`` (the text of /proc/cpuinfo) computes bf16 natively; None when it
    names no instruction sets."""
    if (found := _instruction_sets(cpuinfo)) is None:
        return None
    key, names = found
    wanted = X86_BF16_FLAGS if key == "flags" else (ARM_BF16_FEATURE,)
    return any(name in names for name in wanted)


def _bf16_names(cpuinfo: str) -> str:
    """What a CPU with native bf16 would list, in this architecture's words."""
    found = _instruction_sets(cpuinfo)
    return (
        f"{ARM_BF16_FEATURE} in {CPUINFO}'s Features"
        if found and found[0] == "Features"
        else f"{' or '.join(X86_BF16_FLAGS)} in {CPUINFO}'s flags"
    )


def cpu_name(cpuinfo: str) -> str:
    """The CPU's name as /proc/cpuinfo gives it ("model name" on x86), else the machine's architecture."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "model name" and value.strip():
            return value.strip()
    return platform.machine() or "unknown CPU"


def read_cpuinfo() -> str:
    """The start of /proc/cpuinfo (the first processor's lines are in it), or "" where there is none (macOS)."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 16)
    except OSError:
        return ""


@dataclass(frozen=True)
class CpuPrecision:
    """bf16 mixed precision asked for on a machine without an accelerator: which CPU, and what runs."""

    # where bf16 was asked for, as the user wrote it
    asked_by: str
    cpu: str
    # None: the CPU's instructions could not be read; bf16 is then kept, as asked
    native_bf16: bool | None
    # --cpu_bf16 true
    forced: bool
    # what /proc/cpuinfo would list if it had native bf16
    lacks: str = ""

    @property
    def mixed_precision(self) -> str:
        """accelerate's mixed precision for this run: "no" (fp32 compute) or "bf16"."""
        return "no" if self.native_bf16 is False and not self.forced else "bf16"

    def line(self) -> str | None:
        """The one line a run prints about it; None where bf16 runs natively or the CPU could not be read."""
        if self.native_bf16 is not False:
            return None
        why = (
            f"this CPU ({self.cpu}) has no native bf16 instructions (no {self.lacks}), so bf16 runs many "
            "times slower than fp32"
        )
        if self.forced:
            return f"{self.asked_by} keeps bf16 compute ({CPU_BF16_SWITCH}) although {why}"
        return f"{self.asked_by} computes in fp32 here: {why}; {CPU_BF16_SWITCH} keeps bf16"

    def record(self) -> dict:
        """fsdp_report.json's ``precision.cpu_bf16``."""
        return {
            "asked_by": self.asked_by,
            "cpu": self.cpu,
            "native_bf16": self.native_bf16,
            "forced": self.forced,
            "compute": "float32" if self.mixed_precision == "no" else "bfloat16",
            "note": self.line(),
        }


_CPU_PRECISION: CpuPrecision | None = None


def choose_cpu_precision(bf16_flag: bool, force: bool, env=None, cpuinfo: str | None = None) -> CpuPrecision | None:
    """Decide the compute precision of a run on a machine without an accelerator, before TrainingArguments reads it:
    where bf16 is asked for (``mixed_precision: bf16`` from the launcher, or ``bf16_flag``, TrainingArguments' bf16)
    and the CPU lacks native bf16, set the launcher's ACCELERATE_MIXED_PRECISION in ``env`` (this process's environment
    when None) to "no"; the caller then clears its own bf16 flag when the result's ``mixed_precision`` is "no".
    ``force`` (--cpu_bf16 true) keeps bf16. Returns the decision (also :func:`cpu_precision`), or None where there
    is an accelerator or bf16 is not asked for. Reads /proc/cpuinfo's first lines (``cpuinfo`` replaces them in tests);
    measures nothing."""
    global _CPU_PRECISION
    env = os.environ if env is None else env
    launcher_bf16 = env.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "bf16"
    if force and not (launcher_bf16 or bf16_flag):
        raise RecipeError(
            f"cpu_bf16 keeps bf16 mixed precision on a CPU without native bf16, and this run asks for none "
            f"(mixed_precision: {env.get('ACCELERATE_MIXED_PRECISION', 'no')}, bf16: false): drop cpu_bf16, or set "
            "mixed_precision: bf16 in the accelerate config"
        )
    if accelerator_present() or not (launcher_bf16 or bf16_flag):
        _CPU_PRECISION = None
        return None
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    asked_by = (
        "bf16 mixed precision (accelerate's mixed_precision: bf16)"
        if launcher_bf16
        else "bf16 mixed precision (bf16: true)"
    )
    decision = CpuPrecision(asked_by, cpu_name(text), native_bf16(text), force, _bf16_names(text))
    if decision.mixed_precision == "no":
        # read by TrainingArguments and AcceleratorState; the ranks' own copy
        env["ACCELERATE_MIXED_PRECISION"] = "no"
    _CPU_PRECISION = decision
    return decision


def bf16_weights_line(weights_dtype, how: str, cpuinfo: str | None = None) -> str | None:
    """The one line for a model whose weights are bfloat16 (``how``: --dtype bfloat16, or a bf16 model loaded with
    --dtype auto) on a CPU without native bf16: the weights compute in their own dtype whatever the mixed precision,
    so the fp32 decision above does not reach them. None elsewhere."""
    import torch

    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    if weights_dtype != torch.bfloat16 or accelerator_present() or native_bf16(text) is not False:
        return None
    return (
        f"the model's weights are bfloat16 ({how}): they compute in bf16, and this CPU ({cpu_name(text)}) has "
        "no native "
        f"bf16 instructions (no {_bf16_names(text)}), so training runs many times slower than fp32; --dtype "
        "float32 computes in fp32"
    )


def cpu_precision() -> CpuPrecision | None:
    """What :func:`choose_cpu_precision` decided in this process (None: not called, an accelerator, or no bf16)."""
    return _CPU_PRECISION
