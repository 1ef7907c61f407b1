"""The Trainer train_fsdp.py runs: transformers' Trainer, checked for real sharding, with an exact FSDP1 resume.

``FSDPTrainer`` adds the repository's callbacks (ShardingReport, DescribeCheckpoints) and overrides one
step of resuming. With accelerate 1.15, resuming FSDP1 from a SHARDED_STATE_DICT checkpoint restores an
empty optimizer: ``load_fsdp_optimizer`` builds the template it loads into from the optimizer as it is,
and a freshly created optimizer has no state entries, so DCP fills nothing. Weights, schedule and step
come back, Adam's moments do not, and the run continues silently wrong. Giving the optimizer its state
entries first (``_init_optim_state``: one step with zero gradients and lr 0, exactly what
``get_optimizer_state_dict`` does for FSDP2 before loading) makes DCP restore every moment.

With ``zero1`` (DDP launches only) the optimizer is torch's ZeroRedundancyOptimizer around the Trainer's own
choice (AdamW by default, with the same settings): each rank keeps the state of 1/N of the parameters.
Checkpoints hold the whole state in one optimizer.pt, gathered on rank 0 (``consolidate_state_dict``); a resume
gives every rank its part back (ZeroRedundancyOptimizer.load_state_dict).

It also moves one step of saving. The Trainer deletes checkpoints beyond ``save_total_limit`` as soon as rank 0
has written trainer_state.json, while the other ranks may still be writing their RNG state: a rank killed in
that window left the run with no complete checkpoint (with a limit of 1, the only good one was just deleted).
``FSDPTrainer`` deletes them once every rank is done.

SIGTERM and SIGUSR1 (a cluster's time limit or preemption) end the run after the current optimizer step with a
complete checkpoint of that step (fsdp_recipes.train.preemption).

LoRA (peft) runs under SHARDED_STATE_DICT checkpoint the adapter alone: its weights and its optimizer state, each
rank its slice, not the frozen base (which a resume takes from the model source again, and a merge from the base
model: tools/merge_checkpoint.py --base-model, or the base adapter_config.json names). Stock, those checkpoints come
out empty under FSDP1 (fsdp_recipes.compat.trainer_checkpoints says why, and is the fix); under FULL_STATE_DICT the
checkpoints hold the whole model, as before. ``_lora_checkpoints`` applies the one or the other around the
Trainer's checkpoint saves and loads.

Every training log line carries tokens per second (in all and per device) and, on GPUs, MFU; evaluation logs carry
eval_perplexity; the end-of-run metrics carry the run's averages (fsdp_recipes.train.metrics).
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from fsdp_recipes.ckpt.dtype_match import dtype_mismatch
from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE, FULL_MODEL_FILE, REPLACED_PREFIX
from fsdp_recipes.ckpt.model_match import description_mismatch, model_mismatch, omittable_names, tokenizer_record
from fsdp_recipes.ckpt.rotation import rotate, set_aside
from fsdp_recipes.compat import internals
from fsdp_recipes.compat.trainer_checkpoints import adapter_only_fsdp_checkpoints, whole_model_fsdp_checkpoints
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.removal import make_folder
from fsdp_recipes.train.async_checkpoints import AsyncCheckpoints
from fsdp_recipes.train.export import DescribeCheckpoints, export_dtype, lora_parts
from fsdp_recipes.train.metrics import Throughput, perplexity
from fsdp_recipes.train.optimizer import held_dtypes, optimizer_settings, overridden_settings, zero1_optimizer_class
from fsdp_recipes.train.preemption import Preemption, kill_warning
from fsdp_recipes.train.run_report import add_checkpoint_writes
from fsdp_recipes.train.sharding import ShardingReport

logger = logging.getLogger(__name__)


OVERRIDES = (
    "transformers.Trainer._save_checkpoint",
    "transformers.Trainer._finalize_training",
    "transformers.Trainer._save_optimizer_and_scheduler",
    "transformers.Trainer._load_from_checkpoint",
    "transformers.Trainer._load_optimizer_and_scheduler",
    "transformers.Trainer._load_best_model",
)


class FSDPTrainer(Trainer):
    def __init__(
        self,
        *args,
        zero1: bool = False,
        save_dtype: str = "auto",
        async_checkpoints: bool = True,
        direct_io_checkpoints: bool = True,
        async_checkpoint_staging: str = "auto",
        **kwargs,
    ):
        # a renamed base method would leave ours never called
        internals.require(*OVERRIDES)
        model = kwargs.get("model")
        # the Trainer's own optimizer and settings, each rank stepping its 1/N of the parameters
        if zero1:
            optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(kwargs["args"], model)
            kwargs["optimizer_cls_and_kwargs"] = (
                zero1_optimizer_class(),
                {"optimizer_class": optimizer_cls, **optimizer_kwargs},
            )
        self.zero1 = zero1
        # the Trainer overwrites it with TrainingArguments.use_cache (off for training); saved configs keep the model's
        self.model_use_cache = getattr(getattr(model, "config", None), "use_cache", None)
        super().__init__(*args, **kwargs)
        # before sharding
        self.trainable_total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        # the final folder's (fsdp_report.json)
        self.save_dtype, self.export_dtype = (save_dtype, export_dtype(self.model, save_dtype))
        # name -> full shape, before sharding: what a checkpoint resumed into this model must hold (model_mismatch)
        self.weight_shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.omittable_names = omittable_names(self.model)
        self.add_callback(ShardingReport(self))
        self.describer = DescribeCheckpoints(self, self.processing_class)
        self.add_callback(self.describer)
        # SIGTERM/SIGUSR1: checkpoint at the end of the current step, then stop
        self.preemption = Preemption()
        self.add_callback(self.preemption)
        # Run.build sets its FLOPs per token and peak where MFU is known
        self.throughput = Throughput()
        # checkpoints written while training goes on
        self.async_saves = AsyncCheckpoints(self, async_checkpoints, direct_io_checkpoints, async_checkpoint_staging)
        self.add_callback(self.async_saves)
        self.run_dir, self.save_limit = Path(self.args.output_dir), self.args.save_total_limit

    def train(self, *args, **kwargs):
        """The Trainer's train, then the asynchronous save still in flight written (or abandoned on an exception)."""
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            self.async_saves.abandon()
            raise
        self.async_saves.finish()
        self.async_saves.release()
        if self.args.save_strategy != "no":
            add_checkpoint_writes(self.args.output_dir, self.accelerator, self.async_saves.report())
        return result

    def _finalize_training(self, *args, **kwargs):
        """The Trainer's end-of-training cleanup (save_total_limit 1 with a best checkpoint: every other checkpoint
        folder goes), done by our rotation after the save in flight has finished: the Trainer's own shutil.rmtree
        would delete a folder whose files are still being written, and whatever a checkpoint-N folder holds besides
        a checkpoint (a file a user put there; rotate keeps such a folder and says so)."""
        self.async_saves.finish()
        limit = self.args.save_total_limit
        with self.trainer_deletes_nothing():
            result = super()._finalize_training(*args, **kwargs)
        if self.args.should_save and limit == 1 and self.state.best_model_checkpoint is not None:
            rotate(self.run_dir, 1, keep=self.state.best_model_checkpoint, warn=logger.warning, keep_newest=False)
        return result

    @contextmanager
    def trainer_deletes_nothing(self):
        """save_total_limit off: the only condition of the Trainer's two checkpoint deletes (rotate_checkpoints in
        _save_checkpoint, the rmtree in _finalize_training), whose work our rotation does (test_removal lists them)."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            yield
        finally:
            self.args.save_total_limit = limit

    def rotate_checkpoints(self) -> None:
        """Checkpoints beyond save_total_limit deleted, once every rank has finished the newest (rank 0)."""
        rotate(self.run_dir, self.save_limit, keep=self.state.best_model_checkpoint, warn=logger.warning)

    def close_progress_bar(self) -> None:
        """A run that fails mid-training leaves tqdm's bar open, without its newline."""
        from transformers.trainer_callback import ProgressCallback

        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()
                callback.training_bar = None

    def training_step(self, model, inputs, *args, **kwargs):
        self.throughput.count(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self.throughput.excluded():
            return super().evaluate(*args, **kwargs)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Called on every rank at the same steps (the Trainer's logging decision is global): the token count's
        all-reduce is matched."""
        if "loss" in logs:
            logs.update(self.throughput.window(self._sum_over_ranks, self.accelerator.num_processes))
        if "eval_loss" in logs:
            logs["eval_perplexity"] = perplexity(logs["eval_loss"])
        # the end-of-run metrics; the steps after the last logging step count too
        if "train_runtime" in logs:
            self.throughput.window(self._sum_over_ranks, self.accelerator.num_processes)
            logs.update({f"train_{k}": v for k, v in self.throughput.averages(self.accelerator.num_processes).items()})
        super().log(logs, *args, **kwargs)

    def _sum_over_ranks(self, value: int) -> int:
        import torch

        if self.accelerator.num_processes == 1:
            return value
        return int(self.accelerator.reduce(torch.tensor(value, device=self.accelerator.device), reduction="sum").item())

    def _fsdp1_sharded(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin is not None and plugin.fsdp_version == 1 and "SHARDED" in str(plugin.state_dict_type)

    def _sharded(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin is not None and "SHARDED" in str(plugin.state_dict_type)

    @contextmanager
    def _lora_checkpoints(self):
        if not self.is_fsdp_enabled or lora_parts(self.accelerator.unwrap_model(self.model))[1] is None:
            yield
            return
        plugin = self.accelerator.state.fsdp_plugin
        with (
            adapter_only_fsdp_checkpoints()
            if self._sharded() or plugin.fsdp_version == 2
            else whole_model_fsdp_checkpoints()
        ):
            yield

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank sends its part to rank 0, which writes the whole state as one optimizer.pt
        if self.zero1:
            self.optimizer.optimizer.consolidate_state_dict(to=0)
        with self._lora_checkpoints():
            super()._save_optimizer_and_scheduler(output_dir)

    def inexact_full_resume(self) -> bool:
        """FSDP1 + FULL_STATE_DICT + use_orig_params: measured (torch 2.13, accelerate 1.15), the resumed weights and
        Adam
        state equal the saved ones, yet the first update after the resume differs from the run that never stopped,
        with or without sync_module_states; use_orig_params false resumes to the same bits
        (tests/integration/test_resume_refusals.py)."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return (
            plugin is not None
            and plugin.fsdp_version == 1
            and bool(plugin.use_orig_params)
            and "FULL" in str(plugin.state_dict_type)
        )

    def resume_mismatch(self, checkpoint: str) -> str | None:
        """Why ``checkpoint`` cannot be resumed into this run's model (another size, layer count or LoRA setting),
        checked from its file headers before anything loads; None when it matches."""
        if self.inexact_full_resume() and (Path(checkpoint) / FULL_MODEL_FILE).is_file():
            return (
                f"{checkpoint} is a FULL_STATE_DICT checkpoint, which FSDP1 with fsdp_use_orig_params: true "
                "does not resume "
                "exactly (the run would drift from the one that never stopped; a checkpoint saved this way "
                "does not load "
                "with use_orig_params false either): merge it (tools/merge_checkpoint.py) and train on from "
                "the merged model, "
                "and train with fsdp_state_dict_type: SHARDED_STATE_DICT (every shipped config) or "
                "fsdp_use_orig_params: false"
            )
        # the frozen base may be absent (an adapter-only checkpoint: it comes from the model source); when
        # present, it must fit
        if problem := model_mismatch(checkpoint, self.weight_shapes, self.omittable_names):
            return problem
        # from the dtypes this run declares (--dtype, mixed precision), not the prepared model's: the same verdict on
        # every machine, and the frozen base of a LoRA run, which its checkpoint does not store, compared too
        upcast = self.is_fsdp_enabled and self.accelerator.mixed_precision != "no"
        if problem := dtype_mismatch(checkpoint, *held_dtypes(self.accelerator.unwrap_model(self.model), upcast)):
            return problem
        # the same shapes may still be another model (heads, rope, activation), adapter (lora_alpha) or tokenizer
        base, lora = lora_parts(self.accelerator.unwrap_model(self.model))
        return description_mismatch(
            checkpoint,
            json.loads(base.config.to_json_string(use_diff=True)),
            lora.to_dict() if lora is not None else None,
            tokenizer_record(self.processing_class),
        )

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        with self._lora_checkpoints():
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        """--load_best_model_at_end of a LoRA run: the best checkpoint loaded as a resume loads it
        (_load_from_checkpoint,
        within _lora_checkpoints). The stock load asks peft for the adapter's state dict, whose names lack the adapter
        name our checkpoints keep (``lora_A.weight``, stored as ``lora_A.default.weight``): FSDP2 raised after training
        (no model/ written), FSDP1 selected nothing and kept the last step's weights without a word. Full fine-tuning
        keeps the stock load."""
        if not self.is_fsdp_enabled or lora_parts(self.accelerator.unwrap_model(self.model))[1] is None:
            super()._load_best_model()
            return
        if self.accelerator.is_main_process:
            logger.info(
                f"loading the best model from {self.state.best_model_checkpoint} ({self.args.metric_for_best_model} "
                f"{self.state.best_metric})"
            )
        self._load_from_checkpoint(self.state.best_model_checkpoint, self.model_wrapped)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._fsdp1_sharded():
            init_optim_state = internals.get("torch.distributed.checkpoint.state_dict._init_optim_state")
            # the torch optimizer inside accelerate's wrapper
            init_optim_state(self.optimizer.optimizer)
        asked = optimizer_settings(self.optimizer, self.lr_scheduler)
        # DCP's, a BaseException carrying each rank's
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except (RuntimeError, KeyError, ValueError, CheckpointException) as err:
            found = re.search(r"[^\n]*param_groups[^\n]*", str(err))
            if checkpoint is None or found is None:
                raise
            # another --optim (SGD's momentum where AdamW has betas): torch names the missing key, in a
            # traceback per rank
            raise RecipeError(
                f"{Path(checkpoint).name}'s optimizer state does not fit this run's optimizer (--optim "
                f"{getattr(self.args.optim, 'value', self.args.optim)}; {found.group(0).strip()[:200]}): resume "
                "with the --optim it was trained "
                "with, or merge it (tools/merge_checkpoint.py) and start a new run from the merged model"
            ) from None
        if checkpoint is not None and (
            problem := overridden_settings(
                asked, optimizer_settings(self.optimizer, self.lr_scheduler), Path(checkpoint).name
            )
        ):
            # every rank loaded the same groups: all stop alike, before the first step
            raise RecipeError(problem)

    def say_what_a_kill_loses(self, run_dir: Path, name: str) -> None:
        """The stop's save (rank 0): which checkpoints are still to be written, the background save in flight first,
        and where a resume starts were the job killed before they are (fsdp_recipes.train.preemption)."""
        if self.preemption.stopped_at is None or not self.is_world_process_zero():
            return
        pending = self.async_saves.pending
        writing = ([pending.folder.name] if pending is not None else []) + [name]
        stop = self.preemption.describe()
        if line := kill_warning(stop, self.preemption.stopped_at, self.state.global_step, writing, run_dir):
            logger.warning(line)

    @contextmanager
    def model_config_for_saving(self):
        """The model's own use_cache in every config.json written meanwhile (checkpoints, the final folder): the
        Trainer sets it to TrainingArguments.use_cache, false by default, and a folder saved that way would return no
        KV cache from a plain forward call."""
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if config is None or self.model_use_cache is None or not hasattr(config, "use_cache"):
            yield
            return
        training = config.use_cache
        config.use_cache = self.model_use_cache
        try:
            yield
        finally:
            config.use_cache = training

    def _save_checkpoint(self, model, trial) -> None:
        # writing a checkpoint is not training time
        with self.throughput.excluded(), self.model_config_for_saving():
            run_dir = internals.get("transformers.Trainer._get_output_dir")(self, trial=trial)
            folder = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            background = self.async_saves.active
            self.say_what_a_kill_loses(Path(run_dir), folder.name)
            if background:
                # at most one save in flight: the previous one completes (and rotates) first
                self.async_saves.finish()
            if self.args.should_save:
                # never rewrite a checkpoint in place: a kill midway would mix two runs' files
                if folder.exists():
                    moved = set_aside(folder, REPLACED_PREFIX)
                    logger.warning(
                        f"{folder} existed (another run's step {self.state.global_step}): moved it to {moved.name}"
                    )
                # marked: rotation and --overwrite_output_dir delete only ours
                make_folder(folder, CHECKPOINT_PURPOSE)
                # before any shard, so before trainer_state.json
                self.describer.describe(folder)
            self.accelerator.wait_for_everyone()
            self.run_dir, self.save_limit = Path(run_dir), self.args.save_total_limit
            # the Trainer's own rotation would run before the other ranks finish: ours runs after (rotate_checkpoints)
            with self.trainer_deletes_nothing():
                with (
                    self.async_saves.saving(folder, self.state.global_step)
                    if background
                    else self.async_saves.writing()
                ):
                    super()._save_checkpoint(model, trial)
            if background:
                # complete, and rotated, once every rank has written it (AsyncCheckpoints)
                return
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                self.rotate_checkpoints()
