"""Train a causal language model with Fully Sharded Data Parallel, through accelerate and the Trainer.

    accelerate launch --config_file accelerate_configs/zero3.yaml train_fsdp.py [recipe.yaml] [--flag value ...]

With no recipe it trains the embedded default (a tiny Llama built from assets/, no hub, no GPU needed).
A recipe YAML sets the defaults of ModelArguments, DataArguments and TrainingArguments; flags override
it. `python train_fsdp.py --help` lists every argument.
"""

import logging
import os
import signal
import sys
from pathlib import Path


def before_training(how: str) -> str:
    """The line for a stop or Ctrl-C before training started (``how``: "interrupted", "stopped by SIGTERM")."""
    return (
        f"train_fsdp.py: {how} before training started: nothing was trained or saved by this run; run the same command "
        "again to start (with --resume_from_checkpoint true, to continue from the last checkpoint of an earlier run)"
    )


def _stopped_while_importing(signum, frame):
    """A stop (SIGTERM, SIGUSR1) or Ctrl-C while torch and transformers import (the first ~5 s) ends the run with the
    line any stop before training gives, not a bare exit 143 or an import traceback; run() then installs the real
    handlers. Nothing has started that needs cleaning up, so the process leaves at once."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        os.write(2, (before_training(how) + "\n").encode())
    os._exit(128 + signum)


for _signum in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
    if signal.getsignal(_signum) is not signal.SIG_IGN:  # an ignored signal (a job started with &) stays ignored
        signal.signal(_signum, _stopped_while_importing)

import transformers  # after the handlers above: importing takes seconds
from torch.distributed.checkpoint.api import CheckpointException
from transformers import set_seed

from fsdp_recipes.ckpt.layout import ADAPTER_DIR, FINAL_MODEL_DIR
from fsdp_recipes.ckpt.stop_advice import disk_full_problem, how_to_go_on
from fsdp_recipes.compat.cpu_fsdp import apply_ddp_timeout, bf16_weights_line, cpu_precision
from fsdp_recipes.config.launcher import tell_launcher
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.values import check_run_length, parse_steps
from fsdp_recipes.errors import CheckpointError, InternalsChanged, NotShardedError, RecipeError, RefusedRemoval
from fsdp_recipes.train import preflight
from fsdp_recipes.train.data import build_datasets
from fsdp_recipes.train.export import finished_checkpoint_step, save_dtype_problem, save_final_model
from fsdp_recipes.train.metrics import LOSS_PLOT, flops_per_token, peak_tflops, plot_losses
from fsdp_recipes.train.model_folder import export_checkpoint
from fsdp_recipes.train.modeling import load_model, load_tokenizer, lora_base, lora_base_identity, use_lora_base
from fsdp_recipes.train.preemption import (
    Stopped,
    quiet_stops,
    stop_received,
    training_began,
    wait_for_stop,
    was_interrupted,
    watch_interrupts,
    watch_stops,
)
from fsdp_recipes.train.profiling import StepProfiler
from fsdp_recipes.train.trainer import FSDPTrainer
from fsdp_recipes.train.upload import upload_final_model

logger = logging.getLogger("train_fsdp")


def main(model_args, data_args, plan):
    # ---------- preflight: input checked; join the process group, decide the resume, take output_dir ----------
    training_args, on_cpu = preflight.start(plan)  # makes FSDP real without a GPU, then joins the process group
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO, stream=sys.stdout)
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    for name in ("httpx", "httpx2"):  # huggingface_hub's HTTP clients: a line per request of a --push_to_hub upload
        logging.getLogger(name).setLevel(logging.WARNING)
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
    if on_cpu:
        logger.info(f"no accelerator found: running {on_cpu} over gloo on CPU (fsdp_recipes.compat.cpu_fsdp)")
        apply_ddp_timeout(training_args.ddp_timeout)  # transformers gives a CPU process group none
    if (precision := cpu_precision()) is not None and (note := precision.line()):
        logger.info(note)  # fp32 (or bf16 kept by --cpu_bf16) on a CPU without native bf16, as preflight.start decided
    preflight.decide_resume(plan, training_args)  # one resume decision for the launch, made on rank 0
    preflight.hold_output_dir(training_args)  # one run per output_dir
    preflight.apply(plan, training_args, say=logger.warning)  # set aside or delete what the checks decided (rank 0)
    if plan.push is not None:
        logger.info(
            f"--push_to_hub: the final model folder is uploaded to {plan.push.describe()} at the end, once "
            "(checkpoints stay in output_dir: sharded, they are no model)"
        )
    # A resume keeps the record of the run that wrote its checkpoints until every check below has passed: a refused
    # resume (another model, another LoRA base) rewrote it before. A new run writes it first: it marks output_dir ours.
    resuming = bool(training_args.resume_from_checkpoint) and preflight.has_run_record(training_args)
    if not resuming:
        preflight.save_resolved_arguments(model_args, data_args, training_args, plan.launch, plan.push)

    if (step := finished_checkpoint_step(training_args)) is not None:
        if resuming:
            preflight.save_resolved_arguments(model_args, data_args, training_args, plan.launch, plan.push)
        logger.info(
            f"{training_args.resume_from_checkpoint} is at step {step}, max_steps is {training_args.max_steps}: "
            f"nothing left to train; writing its model to {Path(training_args.output_dir) / FINAL_MODEL_DIR}"
        )
        if training_args.process_index == 0:
            try:
                export_checkpoint(
                    training_args.resume_from_checkpoint,
                    training_args.output_dir,
                    base_model=lora_base(model_args, training_args.output_dir)
                    or model_args.model_name_or_path
                    or model_args.config_name,
                    log=logger.info,
                    dtype=plan.run_args.save_dtype,
                )
            except (
                CheckpointError
            ) as err:  # one line with its fix (no room, a damaged checkpoint), as the export after training
                raise RecipeError(f"the final export failed: {err}") from None
            if note := stale_model_note(training_args.output_dir):
                logger.warning(note)
            logger.info(final_line(training_args.output_dir))
            upload(plan.push, training_args.output_dir, step)
        return

    # ---------- model and tokenizer ----------
    set_seed(training_args.seed)
    use_lora_base(
        model_args, training_args.output_dir, log=logger.info
    )  # LoRA on a config: its random base, saved once
    tokenizer = load_tokenizer(model_args)

    # ---------- data ----------
    with training_args.main_process_first(desc="dataset preprocessing"):
        train_dataset, eval_dataset, collator = build_datasets(data_args, tokenizer, training_args.seed)
    logger.info(
        f"training examples: {len(train_dataset):,}"
        + (f", evaluation examples: {len(eval_dataset):,}" if eval_dataset else "")
    )
    check_run_length(training_args, len(train_dataset), plan.run_args.profile_steps)  # needs the data's size

    model = load_model(model_args, tokenizer)
    how = f"--dtype {model_args.dtype}" + (": the saved model's dtype" if model_args.dtype == "auto" else "")
    if note := bf16_weights_line(next(model.parameters()).dtype, how):
        logger.info(note)  # once per launch; the fp32 decision for bf16 mixed precision does not reach bf16 weights
    # a LoRA base replaced, zeroed or truncated since the checkpoint (or since this output_dir saved it) is refused
    base_record = lora_base_identity(model_args, training_args.resume_from_checkpoint, log=logger.info)

    # ---------- train ----------
    trainer = FSDPTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=tokenizer,
        zero1=plan.run_args.zero1,
        save_dtype=plan.run_args.save_dtype,
        async_checkpoints=plan.run_args.async_checkpoints,
        direct_io_checkpoints=plan.run_args.direct_io_checkpoints,
        async_checkpoint_staging=plan.run_args.async_checkpoint_staging,
    )
    trainer.describer.base_record = base_record  # into every checkpoint and the adapter folder
    if problem := save_dtype_problem(trainer, plan.run_args.save_dtype):
        raise RecipeError(problem)  # every rank alike, before training
    if plan.run_args.profile_steps:
        trainer.add_callback(
            StepProfiler(
                *parse_steps(plan.run_args.profile_steps), training_args.output_dir, training_args.process_index
            )
        )
    trainer.throughput.flops_per_token = flops_per_token(model, data_args.block_size)
    trainer.throughput.peak = device_peak_flops(plan.run_args.peak_tflops)
    if (
        trainer.inexact_full_resume()
        and training_args.save_strategy != "no"
        and not training_args.resume_from_checkpoint
    ):
        logger.warning(
            "FSDP1 with fsdp_state_dict_type: FULL_STATE_DICT and fsdp_use_orig_params: true writes checkpoints that "
            "do not resume exactly (torch 2.13): a resume is refused; SHARDED_STATE_DICT (every shipped config) resumes exactly"
        )
    if training_args.save_strategy != "no":
        logger.info(trainer.async_saves.describe())
    if training_args.resume_from_checkpoint:
        if problem := trainer.resume_mismatch(training_args.resume_from_checkpoint):
            raise RecipeError(problem)  # every rank reads the same headers: all stop alike, before any load
        logger.info(f"resuming from {training_args.resume_from_checkpoint}")
    if resuming:
        preflight.save_resolved_arguments(model_args, data_args, training_args, plan.launch, plan.push)
    try:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except (Exception, CheckpointException, KeyboardInterrupt) as err:  # DCP's CheckpointException is a BaseException
        trainer.close_progress_bar()  # our one line then starts a line of its own
        if isinstance(err, KeyboardInterrupt):
            raise Interrupted(how_to_go_on(training_args.output_dir)) from None
        if (problem := disk_full_problem(err, training_args.output_dir)) is None:
            raise
        raise RecipeError(problem) from None
    if (step := trainer.preemption.stopped_at) is not None:
        message = (
            f"stopped by {trainer.preemption.describe()} after step {step}: saved {training_args.output_dir}/checkpoint-{step}; "
            "the run is not finished: run the same command with --resume_from_checkpoint true to continue"
        )
        logger.warning(message)
        tell_launcher(f"train_fsdp.py: {message}")
        sys.exit(128 + trainer.preemption.signal)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    if eval_dataset is not None:
        metrics = trainer.evaluate()  # sharded, like training; every rank gets the same numbers
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    trainer.save_state()
    if training_args.process_index == 0 and (
        plot := plot_losses(trainer.state.log_history, Path(training_args.output_dir) / LOSS_PLOT)
    ):
        logger.info(f"loss curve: {plot}")

    # ---------- save ----------
    try:
        with trainer.model_config_for_saving():
            save_final_model(trainer, tokenizer, plan.run_args.save_dtype)
    except (Exception, CheckpointException) as err:  # one line for what has one, as during training
        if isinstance(err, CheckpointError):  # the export's merge of a LoRA run's adapter (rank 0), with its fix
            raise RecipeError(f"the final export failed: {err}") from None
        if (problem := disk_full_problem(err, training_args.output_dir, export=True)) is None:
            raise
        raise RecipeError(problem) from None
    if training_args.process_index == 0 and (note := stale_model_note(training_args.output_dir)):
        logger.warning(note)
    logger.info(final_line(training_args.output_dir))
    if training_args.process_index == 0:
        upload(plan.push, training_args.output_dir, trainer.state.global_step)
    if late := trainer.preemption.late():  # the run is complete: exit 0, and say why the signal changed nothing
        logger.warning(
            f"{late} arrived after the last training step: the run had finished, and its model was written; nothing is left to do"
        )


def upload(push, output_dir: str, step: int | None) -> None:
    """--push_to_hub: the final model (and adapter) to the hub, rank 0, once every rank has finished its part."""
    if push is not None:
        logger.info(f"uploaded to the hub: {upload_final_model(push, output_dir, step, log=logger.info)}")


def stale_model_note(output_dir: str) -> str | None:
    """A run folder an earlier version wrote its model into (config.json and weights at its top level), resumed since:
    that model is an earlier step's, and stays where it is (ours to read, not to delete)."""
    out = Path(output_dir)
    if (out / "config.json").is_file() and any(
        (out / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")
    ):
        return (
            f"{out} still holds the model an earlier version of this repository wrote at its top level (config.json and "
            f"weights): it is an earlier step's; this run's final model is {out / FINAL_MODEL_DIR}. Delete the old files "
            "by hand if you no longer need them"
        )
    return None


def final_line(output_dir: str) -> str:
    """The run's last line: where the model is, alone in its folder (what from_pretrained and an upload take)."""
    out = Path(output_dir)
    adapter = (
        f"; its LoRA adapter: {out / ADAPTER_DIR}" if (out / ADAPTER_DIR / "adapter_config.json").is_file() else ""
    )
    return (
        f"model saved to {out / FINAL_MODEL_DIR} (only the model: loads with AutoModelForCausalLM.from_pretrained, uploads "
        f"with `hf upload`){adapter}; checkpoints and run records stay in {out}"
    )


def device_peak_flops(tflops: float | None) -> float | None:
    """The accelerator's dense bf16 peak in FLOPS for MFU: --peak_tflops, else the table; None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    if tflops is None and (tflops := peak_tflops(name)) is None:
        logger.warning(
            f"MFU is not reported: {name!r} is not in fsdp_recipes/train/metrics.py's table; pass --peak_tflops"
        )
        return None
    return tflops * 1e12


def fail(message: str, code: int) -> None:
    """One line per machine on stderr, and the same line as the launcher's root cause (its report ends with it).

    Every rank fails alike, and local rank 0 prints. The launcher stops the other ranks as soon as one exits, so
    the others wait for local rank 0 to print and exit (the launcher then stops them): were they first, it could be
    stopped before its line. A head start of 3 s was not enough on a loaded machine, where rank 0 can reach its
    error much later than rank 1 (seen: no line at all); a rank whose error rank 0 does not share (a folder only
    it sees) still ends within the wait."""
    quiet_stops()  # the launcher's SIGTERM to the ranks still waiting here is no second failure
    tell_launcher(message)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        wait_for_stop(FAIL_WAIT_SECONDS)  # the launcher's SIGTERM, once local rank 0 has exited, ends the wait
    sys.exit(code)


FAIL_WAIT_SECONDS = 30  # how long a failing rank other than local rank 0 waits for it to print its line


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, with what to run next as output_dir was left (a first save cut short leaves none to
    resume from)."""

    def __init__(self, advice: str):
        super().__init__(advice)
        self.advice = advice


def run() -> None:
    watch_interrupts()
    watch_stops()  # until the Trainer's preemption handler takes over: a stop before training ends in one line
    try:
        try:
            main(*parse_args())  # parse_args reads and checks only; main's preflight acts on its plan
        except (RecipeError, NotShardedError, InternalsChanged, RefusedRemoval, KeyboardInterrupt):
            raise
        except Exception:
            if was_interrupted():  # a peer left on Ctrl-C while this rank was in a collective
                raise KeyboardInterrupt from None
            if signum := stop_received():  # a peer stopped by SIGTERM/SIGUSR1 before training left the collective
                raise Stopped(signum) from None
            raise
    except (RecipeError, NotShardedError, InternalsChanged, RefusedRemoval) as err:
        fail(f"train_fsdp.py: error: {err}", 2)
    except Stopped as stop:
        fail(before_training(f"stopped by {stop.describe()}"), 128 + stop.signum)
    except KeyboardInterrupt as stop:
        if training_began():
            go_on = getattr(
                stop,
                "advice",
                "run the same command with --resume_from_checkpoint true to continue from the last checkpoint",
            )
            fail(
                f"train_fsdp.py: interrupted: nothing was saved since the last checkpoint; {go_on} (SIGTERM or "
                "SIGUSR1 instead of Ctrl-C saves one first)",
                130,
            )
        else:  # parsing, --help, loading: nothing of this run to lose
            fail(before_training("interrupted"), 130)


def exit_after_atexit(code: list[int]) -> None:
    """Registered first, so it runs after every other atexit handler (threads are already joined by then): flush
    and leave. What it skips is only the interpreter tearing down torch, transformers and peft module by module,
    about 1.5 s per process and per launch, after all output is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code[0])


if __name__ == "__main__":
    import atexit

    exit_code = [0]
    atexit.register(exit_after_atexit, exit_code)
    try:
        run()
    except SystemExit as stop:
        exit_code[0] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    except BaseException:
        exit_code[0] = 1  # Python prints the traceback before atexit runs
        raise
