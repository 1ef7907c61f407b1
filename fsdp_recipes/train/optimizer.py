"""The optimizer around a resume: the settings a checkpoint's optimizer state would silently override, compared
before it loads, the dtypes the run holds its parameters and optimizer state in, and ZeRO-1's optimizer (torch's
ZeroRedundancyOptimizer, checkpointable) for DDP launches."""

from __future__ import annotations

from fsdp_recipes.compat import internals

# Param-group entries that say how the optimizer computes, not what it computes, and the scheduled lr of the moment
_NOT_SETTINGS = {"params", "lr", "foreach", "fused", "capturable", "differentiable"}
# What sets a param-group entry from the command line (TrainingArguments); others come with --optim / --optim_args
_FLAGS = {
    "initial_lr": "--learning_rate",
    "base_lr": "--learning_rate",
    "weight_decay": "--weight_decay",
    "betas": "--adam_beta1/--adam_beta2",
    "eps": "--adam_epsilon",
}


def held_dtypes(model, fsdp_mixed_precision: bool) -> tuple[dict[str, str], set[str]]:
    """(name -> dtype this run holds each parameter, and so its optimizer state, in once prepared; the names it does
    not train), as declared before anything is prepared: the dtype the model was built in (--dtype; peft keeps a LoRA
    adapter over a 16-bit base in fp32), and fp32 for every trainable float parameter under FSDP mixed precision
    (``fsdp_mixed_precision``: accelerate 1.15 upcasts those, FSDP1 and FSDP2 alike, and computes in bf16 from fp32
    master weights). ``model``: the model before FSDP wraps it."""
    from fsdp_recipes.ckpt.readers import dtype_name

    held, frozen = {}, set()
    for name, param in model.named_parameters():
        upcast = fsdp_mixed_precision and param.requires_grad and param.is_floating_point()
        held[name] = "float32" if upcast else dtype_name(param.dtype)
        if not param.requires_grad:
            frozen.add(name)
    return held, frozen


def optimizer_settings(optimizer, scheduler) -> list[dict]:
    """Per param group, the hyperparameters this run's arguments set (and the scheduler's base lr)."""
    groups = [{k: v for k, v in group.items() if k not in _NOT_SETTINGS} for group in optimizer.param_groups]
    for group, base in zip(groups, getattr(scheduler, "base_lrs", None) or []):
        group["base_lr"] = base
    return groups


def overridden_settings(asked: list[dict], loaded: list[dict], checkpoint: str) -> str | None:
    """A resume loads the optimizer's and the scheduler's state, and with it the hyperparameters the checkpoint was
    trained with: a learning rate, weight decay, betas or epsilon changed on the command line would be silently
    dropped. The first such setting, named with both values; None when none changed."""
    for n, (mine, theirs) in enumerate(zip(asked, loaded)):
        for key in sorted(mine.keys() & theirs.keys()):
            if not _same(mine[key], theirs[key]):
                flag = _FLAGS.get(key, f"the optimizer's {key} (--optim_args)")
                return (
                    f"{flag} is {_shown(mine[key])} in this run, but {checkpoint} was trained with "
                    f"{_shown(theirs[key])} (param group {n}): "
                    "resuming restores its optimizer and scheduler state, which would silently keep "
                    f"{_shown(theirs[key])}; resume "
                    "with the checkpoint's value, or merge it (tools/merge_checkpoint.py) and start a new run "
                    "from the merged model "
                    "to train with another"
                )
    return None


def _same(a, b) -> bool:
    """Equal as settings: a checkpoint's betas may come back as a list (torch.save of the param groups) where this run
    has a tuple; NaN equals NaN."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _shown(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def zero1_optimizer_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.optim import Optimizer

    class ZeRO1(ZeroRedundancyOptimizer):
        """torch's ZeroRedundancyOptimizer with two changes.

        Before its state was ever consolidated, its state_dict is the plain (empty) one of a fresh optimizer:
        accelerate wraps every optimizer by round-tripping its state_dict on each rank (to move it to the device),
        where ZeroRedundancyOptimizer raises "not consolidated". Checkpoints consolidate first
        (FSDPTrainer._save_optimizer_and_scheduler).

        Consolidation gathers each rank's state with torch.distributed.gather_object. torch's own sends it through
        torch.ByteTensor(bytearray(...)), which copies byte by byte through Python: 38 MB of Adam state took
        ~650 MB more peak memory on the sending rank (torch 2.13, measured), so a model of a few billion
        parameters could not be checkpointed. The result is the same list of local state dicts that
        ZeroRedundancyOptimizer.state_dict() turns into the global one.
        """

        consolidated = False

        def consolidate_state_dict(self, to: int = 0) -> None:
            import torch
            import torch.distributed as dist

            local = self.optim.state_dict()
            # on CPU: a CUDA tensor would come back on the sender's device index in the receiving process
            local["state"] = {
                i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in local["state"].items()
            }
            gathered = [None] * self.world_size if self.rank == to else None
            dist.gather_object(local, gathered, group=self.process_group, group_dst=to)
            internals.set_attr(self, "torch.distributed.optim.ZeroRedundancyOptimizer._all_state_dicts", gathered or [])
            self.consolidated = True

        def state_dict(self):
            # a fresh optimizer: no state anywhere yet
            if not self.consolidated and not self.optim.state:
                return Optimizer.state_dict(self)
            return super().state_dict()

    return ZeRO1
