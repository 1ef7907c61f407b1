"""Proof that training is really sharded: wrapper type and the parameter elements each rank holds."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import is_compiled_module
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from fsdp_recipes.ckpt.layout import PUBLISHED, REPORT_NAME, published
from fsdp_recipes.compat import internals, rank0_loading
from fsdp_recipes.compat.cpu_fsdp import cpu_precision, fsdp_requested, launched_world_size
from fsdp_recipes.config.strategy import fsdp_strategy_name
from fsdp_recipes.errors import NotShardedError
from fsdp_recipes.train.run_report import add_measured_bytes, add_peak_memory

# set by module.compile(): accelerate's regional compilation
COMPILED_CALL = "torch.nn.Module._compiled_call_impl"
logger = logging.getLogger("train_fsdp")


def wrapper_kind(model: torch.nn.Module) -> str:
    if isinstance(model, FullyShardedDataParallel):
        return "FSDP1"
    if isinstance(model, FSDPModule):
        return "FSDP2"
    return type(model).__name__


def unwrapped_model_class(model: torch.nn.Module) -> type:
    """The module's own class: FSDP2 swaps in a subclass named FSDP<Class>, which must never reach config.json or
    the report."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def param_elements(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank stores, elements of the whole model), padding excluded."""
    if isinstance(model, FullyShardedDataParallel):
        local = total = 0
        for module in FullyShardedDataParallel.fsdp_modules(model):
            handle = internals.attr(module, "torch.distributed.fsdp.FullyShardedDataParallel._handle")
            if handle is None:
                continue
            flat = handle.flat_param
            whole = internals.attr(
                flat, "torch.distributed.fsdp._flat_param.FlatParameter._unpadded_unsharded_size"
            ).numel()
            total += whole
            if handle.uses_sharded_strategy:
                local += internals.attr(
                    flat, "torch.distributed.fsdp._flat_param.FlatParameter._sharded_size"
                ).numel() - internals.attr(flat, "torch.distributed.fsdp._flat_param.FlatParameter._shard_numel_padded")
            else:
                local += whole
        return local, total
    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total


def trainable_elements(model: torch.nn.Module) -> int:
    """Elements of trainable parameters this rank stores (FSDP2: local parts of DTensors; FSDP1 with
    use_orig_params: the parameters are views into this rank's shard)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters() if p.requires_grad)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The trainable parameters' names with layer numbers folded (``...layers.*.self_attn.q_proj.lora_A...``)."""
    import re

    names = {
        re.sub(r"\.\d+\.", ".*.", n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""))
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return sorted(names)


def _local(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (FSDP1: its flat-parameter shards,
    padding included; FSDP2: the local parts of the DTensors)."""
    if isinstance(model, FullyShardedDataParallel):
        handles = [
            internals.attr(m, "torch.distributed.fsdp.FullyShardedDataParallel._handle")
            for m in FullyShardedDataParallel.fsdp_modules(model)
        ]
        flats = [h.flat_param for h in handles if h is not None]
        params, grads = sum(_local(f) for f in flats), sum(_local(f.grad) for f in flats)
    else:
        params = sum(_local(p) for p in model.parameters())
        grads = sum(_local(p.grad) for p in model.parameters())
    optim = 0
    if optimizer is not None:
        for state in local_optimizer(optimizer).state.values():
            optim += sum(_local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": optim}


def gather(obj, accelerator) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * accelerator.num_processes
    dist.all_gather_object(out, obj)
    return out


def expected_fsdp_version(training_args=None) -> int | None:
    """The FSDP version asked for, by TrainingArguments' own --fsdp (the torchrun route) or by the accelerate
    launcher's config, or None when nobody asked for FSDP."""
    if training_args is not None and getattr(training_args, "fsdp_plugin_args", None):
        return int(training_args.fsdp_plugin_args["fsdp_version"])
    if fsdp_requested():
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def _dtype(value) -> str | None:
    return str(value).removeprefix("torch.") if value is not None else None


def wrapped_units(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each class FSDP wraps as a unit of its own (the root included)."""
    if isinstance(model, FullyShardedDataParallel):
        classes = [type(m.module).__name__ for m in FullyShardedDataParallel.fsdp_modules(model)]
    else:
        classes = [unwrapped_model_class(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
    return {name: classes.count(name) for name in sorted(set(classes))}


def precision_contract(model: torch.nn.Module, accelerator, saved_model: str | None = None) -> dict:
    """The dtypes the run keeps and moves: master weights (what the optimizer updates), compute (FSDP's mixed
    precision policy, else accelerate's autocast), gradient reduction, and the saved model (the final folder's
    weights: --save_dtype, by default the master weights'). The optimizer state's dtype is added after the first
    step, when it exists."""
    master = next((p.dtype for p in model.parameters()), None)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))
    compute = getattr(policy, "param_dtype", None) or autocast or master
    reduce = getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or master
    contract = {
        "master_weights": _dtype(master),
        "compute": _dtype(compute),
        "gradient_reduction": _dtype(reduce),
        "optimizer_state": None,
        "saved_model": saved_model or _dtype(master),
    }
    # bf16 asked for without an accelerator: this CPU, and what runs
    if (cpu := cpu_precision()) is not None:
        record = cpu.record()
        # bf16 weights (--dtype bfloat16) compute in bf16 whatever the decision
        if record["compute"] != contract["compute"]:
            record["compute"] = contract["compute"]
            record["note"] = (
                f"the model's weights are {contract['master_weights']}: they compute in {contract['compute']} "
                "whatever the mixed precision"
            )
        contract["cpu_bf16"] = record
    return contract


def verify_and_report(
    model: torch.nn.Module,
    accelerator,
    output_dir: str,
    training_args=None,
    trainable_total: int | None = None,
    optimizer=None,
    saved_model: str | None = None,
) -> dict:
    """Check the prepared model against the launch config on every rank; rank 0 writes the report.

    Raises NotShardedError on every rank when FSDP was asked for and is not what runs, or when the launcher started
    several processes and each trains alone (accelerate's DistributedType.NO: N unconnected runs).
    """
    rank0_loading.check_fsdp1_sent()
    kind = wrapper_kind(model)
    local, total = param_elements(model)
    # counted before sharding (FSDPTrainer)
    trainable_total = total if trainable_total is None else trainable_total
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    rank_info = {
        "rank": accelerator.process_index,
        "wrapper": kind,
        "local_param_elements": local,
        "local_trainable_elements": trainable_elements(model),
        # compiled in place (accelerate's regional compilation), or the torch.compile wrapper of --torch_compile
        "compiled_modules": sum(
            is_compiled_module(m) or internals.attr(m, COMPILED_CALL) is not None for m in model.modules()
        ),
    }
    gathered = gather(rank_info, accelerator)
    report = {
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "sharding_strategy": _strategy_name(plugin, getattr(accelerator, "parallelism_config", None), optimizer),
        "world_size": accelerator.num_processes,
        "device": str(accelerator.device),
        "total_param_elements": total,
        "trainable_param_elements": trainable_total,
        "trainable": trainable_names(model) if trainable_total < total else "all",
        "wrapped_units": wrapped_units(model),
        "precision": precision_contract(model, accelerator, saved_model),
        "ranks": gathered,
    }
    if (runs := fsdp1_runs_as(model)) and runs != report["sharding_strategy"]:
        report["configured_strategy"], report["sharding_strategy"] = report["sharding_strategy"], runs
    launched = launched_world_size()
    if launched > 1 and accelerator.num_processes == 1:
        raise NotShardedError(
            f"the launcher started {launched} processes but each trains alone (distributed type "
            f"{report['distributed_type']}): launch with `accelerate launch --config_file "
            "accelerate_configs/<config>.yaml`"
        )
    want = expected_fsdp_version(training_args)
    if want is not None and kind != f"FSDP{want}":
        raise NotShardedError(
            f"the launch asks for FSDP{want} but the model is {kind} "
            f"(distributed type {report['distributed_type']}, {accelerator.num_processes} process(es)); "
            "launch with `accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes 2+`"
        )
    if accelerator.is_main_process:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        # an earlier export's folders stay ours (layout.is_published)
        if earlier := published(Path(output_dir)):
            report[PUBLISHED] = earlier
        (Path(output_dir) / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _zero1(optimizer):
    """ZeRO-1's ZeroRedundancyOptimizer inside accelerate's AcceleratedOptimizer, or None."""
    # Only a run that built one has imported its module: importing it to ask costs other ranks a second of CPU.
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", ())
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, zero) else None


def local_optimizer(optimizer):
    """The torch optimizer that holds this rank's state: inside accelerate's wrapper, and inside ZeRO-1's
    ZeroRedundancyOptimizer (whose own ``state`` stays empty; its local optimizer ``optim`` steps this rank's part)."""
    if (zero := _zero1(optimizer)) is not None:
        return zero.optim
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_state_dtype(optimizer) -> str | None:
    for state in local_optimizer(optimizer).state.values():
        for value in state.values():
            # Adam's moments, not its step counter
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return _dtype(value.dtype)
    return None


def peak_memory() -> dict[str, int]:
    """This process's peak memory so far: resident set (Linux reports kibibytes) and, on CUDA, the most the caching
    allocator ever handed out (torch.cuda.max_memory_allocated) and reserved."""
    import resource

    peak = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        peak["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return peak


# The moments ShardingReport records CUDA memory at, in run order: a run's peak over the estimate is then placed in
# loading and prepare, the first forward+backward, the first optimizer step, the steps before the first save or
# the save itself.
CUDA_PHASES = ("before_training", "after_first_backward", "after_first_step", "before_first_save", "after_first_save")


def phase_keys(phase: str) -> tuple[str, str]:
    """fsdp_report.json's peak_memory keys for ``phase``: (the peak so far then, what was allocated then)."""
    return f"cuda_max_allocated_{phase}_bytes", f"cuda_allocated_{phase}_bytes"


def cuda_memory_now(phase: str) -> dict[str, int]:
    """On CUDA, the allocator's peak so far and what is allocated now, under ``phase``'s keys; nothing elsewhere."""
    if phase not in CUDA_PHASES:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(CUDA_PHASES)}")
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    peak, held = phase_keys(phase)
    return {peak: torch.cuda.max_memory_allocated(), held: torch.cuda.memory_allocated()}


def fsdp1_runs_as(model) -> str | None:
    """The strategy an FSDP1 root runs, which torch may have changed from the configured one: a shard group of one
    process (one GPU, or HYBRID_SHARD with one process per node) runs NO_SHARD. None for other wrappers."""
    strategy = getattr(model, "sharding_strategy", None) if wrapper_kind(model) == "FSDP1" else None
    # torch's _HYBRID_SHARD_ZERO2 is accelerate's
    return strategy.name.lstrip("_") if strategy is not None else None


def _strategy_name(plugin, parallelism_config=None, optimizer=None) -> str | None:
    """The strategy that runs (fsdp_recipes.config.strategy's names), from accelerate's FSDP plugin; without FSDP,
    ZERO1 or None (DDP: replicated)."""
    if plugin is None:
        return "ZERO1" if _zero1(optimizer) is not None else None
    if plugin.fsdp_version == 2:
        # FSDP2 expresses HYBRID_SHARD as a (dp_replicate, dp_shard) mesh rather than a strategy name.
        replicas = parallelism_config.dp_replicate_size if parallelism_config is not None else 1
        return fsdp_strategy_name(2, reshard_after_forward=plugin.reshard_after_forward, dp_replicate_size=replicas)
    strategy = plugin.sharding_strategy
    return fsdp_strategy_name(plugin.fsdp_version, sharding_strategy=strategy.name if strategy is not None else None)


class ShardingReport(TrainerCallback):
    """Once the Trainer has prepared the model, stop unless it is FSDP-wrapped as the config asks; then record in
    fsdp_report.json what each rank holds: parameter elements, bytes of model states after the first step, and
    its peak memory at the end of training (resident set; on GPUs CUDA's max allocated)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.grad_bytes = None
        self.cuda_phases: dict[str, int] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.cuda_phases = cuda_memory_now("before_training")
        report = verify_and_report(
            self.trainer.model_wrapped,
            self.trainer.accelerator,
            args.output_dir,
            args,
            self.trainer.trainable_total,
            self.trainer.optimizer,
            getattr(self.trainer, "export_dtype", None),
        )
        local = report["ranks"][self.trainer.accelerator.process_index]["local_param_elements"]
        logger.info(
            f"{report['ranks'][0]['wrapper']} {report['sharding_strategy'] or 'replicated'}"
            + (
                f" (configured {report['configured_strategy']}: torch runs a shard group of one so)"
                if "configured_strategy" in report
                else ""
            )
            + f" on {report['world_size']} process(es), "
            f"{report['device']}: this rank holds {local:,} of {report['total_param_elements']:,} parameter elements"
        )
        if report["trainable"] != "all":
            mine = report["ranks"][self.trainer.accelerator.process_index]["local_trainable_elements"]
            logger.info(
                f"trainable: {report['trainable_param_elements']:,} of {report['total_param_elements']:,} "
                "parameter elements "
                f"({report['trainable_param_elements'] / report['total_param_elements']:.2%}), sharded like the "
                "rest: this rank "
                f"holds {mine:,} of them; {len(report['trainable'])} parameter names in fsdp_report.json"
            )
        units, precision = report["wrapped_units"], report["precision"]
        logger.info(
            "wrapped units: "
            + (", ".join(f"{n} x {name}" for name, n in units.items()) or "none (not FSDP)")
            + "; dtypes: master weights "
            f"{precision['master_weights']}, compute {precision['compute']}, gradient reduction "
            f"{precision['gradient_reduction']}, saved model {precision['saved_model']} (fsdp_report.json)"
        )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # gradients exist only between backward and the optimizer step
        if self.grad_bytes is None:
            self.grad_bytes = state_bytes(self.trainer.model_wrapped)["grads"]
            self.cuda_phases |= cuda_memory_now("after_first_backward")

    def on_save(self, args, state, control, **kwargs):
        if phase_keys("after_first_save")[0] not in self.cuda_phases:
            self.cuda_phases |= cuda_memory_now("after_first_save")

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save and phase_keys("before_first_save")[0] not in self.cuda_phases:
            # DefaultFlowCallback has decided: the save follows
            self.cuda_phases |= cuda_memory_now("before_first_save")
        # the optimizer state exists from the first step on
        if state.global_step == 1:
            self.cuda_phases |= cuda_memory_now("after_first_step")
            accelerator = self.trainer.accelerator
            measured = state_bytes(self.trainer.model_wrapped, self.trainer.optimizer)
            add_measured_bytes(
                args.output_dir,
                accelerator,
                gather(self.grad_bytes, accelerator),
                gather(measured, accelerator),
                optimizer_state_dtype(self.trainer.optimizer),
            )

    def on_train_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        add_peak_memory(args.output_dir, accelerator, gather({**peak_memory(), **self.cuda_phases}, accelerator))
