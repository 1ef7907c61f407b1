"""A run's lifecycle in one object: train_fsdp.py calls ``preflight``, ``build``, ``train``, ``export`` and ``close``.

A resumed checkpoint already at max_steps has nothing left to train (``finished``): the run skips build and train
and exports that checkpoint. Every other run ends in the export of its own final weights. Both take the one path
to a model folder (fsdp_recipes.train.model_folder), and the same errors become one line on the way
(fsdp_recipes.train.exits, where every stop and exit code is decided).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import transformers
from transformers import set_seed

from fsdp_recipes.ckpt.layout import FINAL_MODEL_DIR
from fsdp_recipes.compat import hub_deadline
from fsdp_recipes.compat.cpu_fsdp import apply_ddp_timeout, bf16_weights_line, cpu_precision
from fsdp_recipes.config.batch_size import with_examples
from fsdp_recipes.config.values import check_run_length, parse_steps
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train import exits, preflight
from fsdp_recipes.train.data import build_datasets
from fsdp_recipes.train.export import finished_checkpoint_step, save_dtype_problem, save_final_model
from fsdp_recipes.train.metrics import LOSS_PLOT, device_peak_flops, flops_per_token, plot_losses
from fsdp_recipes.train.model_folder import export_checkpoint, final_line, stale_model_note
from fsdp_recipes.train.modeling import load_model, load_tokenizer, lora_base, lora_base_identity, use_lora_base
from fsdp_recipes.train.profiling import StepProfiler
from fsdp_recipes.train.trainer import FSDPTrainer
from fsdp_recipes.train.upload import upload_final_model

# the run's lines carry the script's name
logger = logging.getLogger("train_fsdp")

INEXACT_RESUME = (
    "FSDP1 with fsdp_state_dict_type: FULL_STATE_DICT and fsdp_use_orig_params: true writes checkpoints that "
    "do not resume exactly (torch 2.13): a resume is refused; SHARDED_STATE_DICT (every shipped config) resumes exactly"
)


class Run:
    """One launch on one rank: the parsed arguments and Plan in, the model folder out."""

    def __init__(self, model_args, data_args, plan):
        self.model_args, self.data_args, self.plan = model_args, data_args, plan
        self.run_args = plan.run_args
        # TrainingArguments: built by preflight, which joins the process group
        self.args = None
        self.trainer = self.tokenizer = self.eval_dataset = None
        # the step of a resumed checkpoint already at max_steps
        self.finished_step: int | None = None
        self.recorded = False

    @property
    def finished(self) -> bool:
        return self.finished_step is not None

    def preflight(self) -> None:
        """Join the process group, decide the resume (rank 0, once), take output_dir, set aside what the checks
        decided. A new run writes its record first: it marks output_dir ours."""
        plan = self.plan
        # transformers' and datasets' hub requests too: none waits forever for an answer
        hub_deadline.install()
        # FSDP made real where there is no GPU, then the process group joined
        self.args, on_cpu = preflight.start(plan)
        self._set_up_logging(on_cpu)
        preflight.decide_resume(plan, self.args)
        preflight.hold_output_dir(self.args)
        preflight.apply(plan, self.args, say=logger.warning)
        if plan.push is not None:
            logger.info(
                f"--push_to_hub: the final model folder is uploaded to {plan.push.describe()} at the end, once "
                "(checkpoints stay in output_dir: sharded, they are no model)"
            )
        # A resume keeps the record of the run that wrote its checkpoints until every check has passed (record)
        if not (self.args.resume_from_checkpoint and preflight.has_run_record(self.args)):
            self.record()
        self.finished_step = finished_checkpoint_step(self.args)
        if self.finished:
            logger.info(
                f"{self.args.resume_from_checkpoint} is at step {self.finished_step}, max_steps is "
                f"{self.args.max_steps}: nothing left to train; writing its model to "
                f"{Path(self.args.output_dir) / FINAL_MODEL_DIR}"
            )

    def _set_up_logging(self, on_cpu: str | None) -> None:
        args = self.args
        logging.basicConfig(
            format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO, stream=sys.stdout
        )
        transformers.utils.logging.set_verbosity(args.get_process_log_level())
        # huggingface_hub's HTTP clients log a line per request of an upload
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logger.setLevel(logging.INFO if args.should_log else logging.WARNING)
        if on_cpu:
            logger.info(f"no accelerator found: running {on_cpu} over gloo on CPU (fsdp_recipes.compat.cpu_fsdp)")
            # transformers gives a CPU process group none
            apply_ddp_timeout(args.ddp_timeout)
        # fp32 (or bf16 kept by --cpu_bf16) on a CPU without native bf16, as preflight.start decided
        if (precision := cpu_precision()) is not None and (note := precision.line()):
            logger.info(note)

    def record(self) -> None:
        """output_dir/run_args.json, once: a new run at preflight, a resume once its checks have passed (a refused
        resume, of another model or another LoRA base, leaves the record of the run that wrote its checkpoints)."""
        if not self.recorded:
            preflight.save_resolved_arguments(
                self.model_args, self.data_args, self.args, self.plan.launch, self.plan.push
            )
            self.recorded = True

    def build(self) -> None:
        """Tokenizer, data, model and trainer, every check that needs them made before training, every rank alike."""
        args, run_args = self.args, self.run_args
        set_seed(args.seed)
        # first: what it refuses refuses before a base is built
        self.tokenizer = load_tokenizer(self.model_args)
        # LoRA on a config: its random base, saved once
        use_lora_base(self.model_args, args.output_dir, log=logger.info)
        with args.main_process_first(desc="dataset preprocessing"):
            train_dataset, self.eval_dataset, collator = build_datasets(self.data_args, self.tokenizer, args.seed)
        evaluated = f", evaluation examples: {len(self.eval_dataset):,}" if self.eval_dataset else ""
        logger.info(f"training examples: {len(train_dataset):,}{evaluated}")
        # per_device_train_batch_size auto, as preflight.start chose it
        if self.plan.auto_line is not None:
            say(
                with_examples(
                    self.plan.auto_line, args.per_device_train_batch_size, len(train_dataset), args.world_size
                )
            )
        check_run_length(args, len(train_dataset), run_args.profile_steps)

        model = load_model(self.model_args, self.tokenizer)
        how = f"--dtype {self.model_args.dtype}" + (
            ": the saved model's dtype" if self.model_args.dtype == "auto" else ""
        )
        # once per launch; the fp32 decision for bf16 mixed precision does not reach bf16 weights
        if note := bf16_weights_line(next(model.parameters()).dtype, how):
            logger.info(note)
        # a LoRA base replaced, zeroed or truncated since the checkpoint (or since this output_dir saved it) is refused
        base_record = lora_base_identity(self.model_args, args.resume_from_checkpoint, log=logger.info)

        self.trainer = trainer = FSDPTrainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=self.eval_dataset,
            data_collator=collator,
            processing_class=self.tokenizer,
            zero1=run_args.zero1,
            save_dtype=run_args.save_dtype,
            async_checkpoints=run_args.async_checkpoints,
            direct_io_checkpoints=run_args.direct_io_checkpoints,
            async_checkpoint_staging=run_args.async_checkpoint_staging,
        )
        # the base's identity goes into every checkpoint and the adapter folder
        trainer.describer.base_record = base_record
        if problem := save_dtype_problem(trainer, run_args.save_dtype):
            raise RecipeError(problem)
        if run_args.profile_steps:
            steps = parse_steps(run_args.profile_steps)
            trainer.add_callback(StepProfiler(*steps, args.output_dir, args.process_index))
        trainer.throughput.flops_per_token = flops_per_token(model, self.data_args.block_size)
        trainer.throughput.peak = device_peak_flops(run_args.peak_tflops, warn=logger.warning)
        saving = args.save_strategy != "no"
        if trainer.inexact_full_resume() and saving and not args.resume_from_checkpoint:
            logger.warning(INEXACT_RESUME)
        if saving:
            logger.info(trainer.async_saves.describe())
        if args.resume_from_checkpoint:
            # every rank reads the same headers: all stop alike, before any load
            if problem := trainer.resume_mismatch(args.resume_from_checkpoint):
                raise RecipeError(problem)
            logger.info(f"resuming from {args.resume_from_checkpoint}")

    def train(self) -> None:
        """Train (a stop signal ends the run here, after the step's checkpoint), then evaluate, save the metrics, the
        trainer state and the loss plot."""
        self.record()
        trainer, args = self.trainer, self.args
        with exits.training_errors(trainer, args.output_dir):
            result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        if trainer.preemption.stopped_at is not None:
            exits.stopped_after_checkpoint(trainer.preemption, args.output_dir, log=logger.warning)
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        if self.eval_dataset is not None:
            # sharded, like training: every rank gets the same numbers
            metrics = trainer.evaluate()
            trainer.log_metrics("eval", metrics)
            trainer.save_metrics("eval", metrics)
        trainer.save_state()
        if args.process_index == 0 and (
            plot := plot_losses(trainer.state.log_history, Path(args.output_dir) / LOSS_PLOT)
        ):
            logger.info(f"loss curve: {plot}")

    def export(self) -> None:
        """output_dir/model/: the trained weights (every rank writes its part), or a finished checkpoint's (rank 0,
        the merge's code); then the run's last line, and --push_to_hub's upload (rank 0, once)."""
        args = self.args
        if self.finished:
            self.record()
            if args.process_index != 0:
                return
            # the run's own model source, for a checkpoint without config.json
            base_model = (
                lora_base(self.model_args, args.output_dir)
                or self.model_args.model_name_or_path
                or self.model_args.config_name
            )
            with exits.export_errors(args.output_dir):
                export_checkpoint(
                    args.resume_from_checkpoint,
                    args.output_dir,
                    base_model=base_model,
                    log=logger.info,
                    dtype=self.run_args.save_dtype,
                )
            step = self.finished_step
        else:
            with exits.export_errors(args.output_dir), self.trainer.model_config_for_saving():
                save_final_model(self.trainer, self.tokenizer, self.run_args.save_dtype)
            step = self.trainer.state.global_step
        if args.process_index == 0 and (note := stale_model_note(args.output_dir)):
            logger.warning(note)
        logger.info(final_line(args.output_dir))
        if args.process_index == 0 and self.plan.push is not None:
            uploaded = upload_final_model(self.plan.push, args.output_dir, step, log=logger.info)
            logger.info(f"uploaded to the hub: {uploaded}")

    def close(self) -> None:
        """The run is complete (exit 0); a stop that came after the last step changed nothing, and is said."""
        if self.trainer is not None and (late := self.trainer.preemption.late()):
            logger.warning(
                f"{late} arrived after the last training step: the run had finished, and its model was written; "
                "nothing is left to do"
            )
