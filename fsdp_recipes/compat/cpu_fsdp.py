"""Make accelerate's FSDP path real on a machine without an accelerator.

Why this exists: with accelerate 1.15 every stock way of launching FSDP on a CPU-only machine silently
runs something else (DistributedType.NO, MULTI_CPU + DDP, or one process) and exits 0, because
``AcceleratorState`` only switches to FSDP when the base type is an accelerator type. That would make
every CPU test of this repository test DDP or nothing (README.md, "Without a GPU").

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

These patch private internals of the exact versions pinned in requirements.txt, each named in
fsdp_recipes/compat/internals.py and checked before anything is patched. Nothing here runs when an accelerator exists:
there, the stock path is already real FSDP.
"""

from __future__ import annotations

import functools
import os

import torch

from fsdp_recipes.compat import internals

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
            "FSDP is asked for, but without a GPU FSDP runs over gloo and needs 2 or more processes; this launch has 1: "
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
    internals.require(*CPU_PRIVATE)  # all or nothing: a half-patched run would be wrong without a word
    os.environ["ACCELERATE_USE_CPU"] = "true"
    _patch_accelerator_state()
    _patch_fsdp_plugin()
    _patch_fsdp1_internals()
    _ENABLED = True
    return True


CPU_PRIVATE = (
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

    internals.patch("torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states", lambda module_states: None)
    internals.patch("torch.distributed.fsdp._flat_param.FlatParamHandle.to_cpu", contextlib.contextmanager(lambda self: (yield)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
