"""TrainingArguments' numeric ranges (TRAINING_RULES; VALUE_RULES adds the argument dataclasses' own, which they
check themselves: fsdp_recipes.config.rules) and the checks that need several values at once: a run that would
train nothing, or the wrong thing, without a word. ``check_run_length`` needs the training set's size and runs once
it is built."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from fsdp_recipes.config.accelerate_config import compile_modes
from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.config.model_source import model_positions
from fsdp_recipes.config.rules import INF, MAX_COUNT, MAX_WORKERS, WORKERS_BOUND, Rule, problem, shown
from fsdp_recipes.config.run_arguments import RunArguments
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError


def check_training_values(raw, model_args: ModelArguments, data_args: DataArguments) -> None:
    """Values TrainingArguments accepts that train nothing, or the wrong thing, without a word."""
    # TrainingArguments would os.makedirs('')
    if raw.output_dir is not None and not str(raw.output_dir).strip():
        raise RecipeError(f"output_dir={raw.output_dir!r} is empty: give the folder to write the run to")
    if raw.max_steps == 0:
        raise RecipeError(
            "max_steps=0 would still train one step and save checkpoint-1: give a positive number of "
            "steps, or leave max_steps at -1 to train num_train_epochs"
        )
    # every numeric TrainingArguments field: finite, and within its rule
    check_value_ranges(raw)
    # a load check may want exactly this; a training run never does
    if raw.learning_rate == 0:
        say("warning: learning_rate=0: the weights will not change (fine to check that a model loads; not training)")
    # the decay multiplies each weight by 1 - lr x wd every step
    if raw.learning_rate * raw.weight_decay >= 1:
        raise RecipeError(
            f"weight_decay={shown(raw.weight_decay)} with learning_rate={shown(raw.learning_rate)} would "
            "multiply every weight by 1 - learning_rate x weight_decay = "
            f"{1 - raw.learning_rate * raw.weight_decay:.3g} "
            f"each step, before any gradient: give a weight_decay below {1 / raw.learning_rate:g}, e.g. 0.01"
        )
    if raw.max_steps > 0 and raw.warmup_steps >= 1:
        warn_long_warmup(raw.warmup_steps, raw.max_steps, raw.learning_rate)
    if str(raw.eval_strategy or "no").lower() not in ("no", "intervalstrategy.no") and not data_args.evaluates:
        raise RecipeError(
            f"eval_strategy={raw.eval_strategy} needs evaluation data: set validation_file, "
            "validation_split_percentage or dataset_test_split"
        )
    # torch.compile reads "" as default
    if raw.torch_compile_mode and raw.torch_compile_mode not in compile_modes():
        raise RecipeError(
            f"torch_compile_mode={raw.torch_compile_mode!r} is not a mode torch.compile knows: give one of "
            f"{', '.join(compile_modes())}"
        )
    if raw.profile_steps is not None:
        try:
            first, last = parse_steps(str(raw.profile_steps))
        except ValueError as err:
            raise RecipeError(f"profile_steps={err}") from None
        if raw.max_steps > 0 and last > raw.max_steps:
            raise RecipeError(
                f"profile_steps={raw.profile_steps} ends after max_steps={raw.max_steps}: profile steps within the run"
            )
    revision = None if model_args.model_revision == "main" else model_args.model_revision
    positions = model_positions(model_args.model_name_or_path or model_args.config_name, revision)
    if positions is not None and data_args.block_size > positions:
        raise RecipeError(
            f"block_size={data_args.block_size} is longer than the model's {positions} positions: "
            f"use block_size {positions} or less"
        )


def check_task_flags(raw, data_args: DataArguments, explicit: set[str]) -> None:
    """TrainingArguments' do_train, do_eval and do_predict are read by example scripts, never by the Trainer: this
    script always trains, and evaluates exactly when it has evaluation data. A value given that means otherwise
    would be ignored without a word. ``explicit``: the keys the recipe or a flag set (do_train's default is false)."""
    if "do_train" in explicit and not raw.do_train:
        raise RecipeError(
            "do_train=false: this script always trains (the Trainer ignores do_train; example scripts read "
            "it): drop do_train"
        )
    if getattr(raw, "do_predict", False):
        raise RecipeError(
            "do_predict=true: this script has no prediction step (the Trainer ignores do_predict): drop it"
        )
    if "do_eval" in explicit and raw.do_eval and not data_args.evaluates:
        raise RecipeError(
            "do_eval=true needs evaluation data: set validation_file, validation_split_percentage or "
            "dataset_test_split (evaluation then runs at the end, and by eval_strategy)"
        )
    if "do_eval" in explicit and not raw.do_eval and data_args.evaluates:
        raise RecipeError(
            "do_eval=false, but evaluation data is given: it is evaluated at the end (and by eval_strategy) "
            "whatever do_eval says: drop do_eval, or the evaluation data"
        )


# metrics this repository adds to every evaluation (FSDPTrainer.log), where lower is better: the Trainer takes any
# metric whose name does not end in "loss" as greater-is-better, and kept the worst checkpoint as the best
LOWER_IS_BETTER = ("perplexity", "eval_perplexity")


# what every evaluation of this script reports (no compute_metrics): the Trainer's own, and eval_perplexity
EVAL_METRICS = ("loss", "perplexity", "runtime", "samples_per_second", "steps_per_second")


def best_metric_direction(raw, explicit: set[str]) -> None:
    """metric_for_best_model must be one every evaluation reports (another is the Trainer's KeyError at the first
    evaluation, mid-run); greater_is_better is set where the Trainer's default would be wrong (on ``raw``, from which
    TrainingArguments is built); a value given stays."""
    metric = getattr(raw, "metric_for_best_model", None)
    if metric is not None and str(metric).removeprefix("eval_") not in EVAL_METRICS:
        raise RecipeError(
            f"metric_for_best_model={metric!r} is not reported by this script's evaluations (no compute_metrics "
            f"here): use one of {', '.join(f'eval_{m}' for m in EVAL_METRICS[:2])} (or drop it: eval_loss)"
        )
    if metric in LOWER_IS_BETTER and "greater_is_better" not in explicit:
        raw.greater_is_better = False


# transformers' set_seed seeds numpy, which refuses more
SEED_MAX = 2**32 - 1


STEPS_FIX = "give a whole number of optimizer steps, or a fraction of the run below 1 (0.1: every tenth of it)"


# A rule for every int or float field of TrainingArguments; ours declare theirs (RULES, beside their fields).
# tests/unit/config/test_values.py fails for a numeric field that has neither a rule nor a place in FINITE_ONLY, so
# a field a new transformers adds gets a decision.
TRAINING_RULES: dict[str, Rule] = {
    "per_device_train_batch_size": Rule(1, INF, "give at least 1 example per process and micro-batch"),
    "per_device_eval_batch_size": Rule(1, INF, "give at least 1 example per process and evaluation batch"),
    "num_train_epochs": Rule(
        0,
        MAX_COUNT,
        "give a positive number of epochs (0.5 trains half of one), or a positive max_steps",
        low_open=True,
    ),
    "max_steps": Rule(
        1, INF, "give a positive number of optimizer steps, or -1 to train num_train_epochs", special=(-1,)
    ),
    "learning_rate": Rule(
        0, 10, "give a rate such as 2e-5 (an Adam-type optimizer moves each weight by about that much a step)"
    ),
    "warmup_steps": Rule(
        0,
        MAX_COUNT,
        "give a whole number of warmup steps, or a fraction of the run below 1 (0.1: the first tenth)",
        fraction=True,
    ),
    "weight_decay": Rule(0, INF, "give 0 for none, or a coefficient such as 0.01"),
    "adam_beta1": Rule(0, 1, "give a decay rate below 1, e.g. 0.9", high_open=True),
    "adam_beta2": Rule(0, 1, "give a decay rate below 1, e.g. 0.999", high_open=True),
    "adam_epsilon": Rule(
        0,
        1,
        "give a small positive number, e.g. 1e-8 (the update is divided by it plus the gradient's scale)",
        low_open=True,
    ),
    "gradient_accumulation_steps": Rule(1, INF, "give 1 (no accumulation) or more micro-batches per optimizer step"),
    "max_grad_norm": Rule(0, INF, "give the clipping threshold, e.g. 1.0, or 0 not to clip"),
    "label_smoothing_factor": Rule(
        0, 1, "give 0 for none, or a factor below 1 such as 0.1 (1 would train towards uniform guesses)", high_open=True
    ),
    "neftune_noise_alpha": Rule(
        0, INF, "give a positive noise scale such as 5, or leave it unset for no noise", low_open=True
    ),
    "torch_empty_cache_steps": Rule(1, INF, "give a positive number of steps, or leave it unset"),
    "logging_steps": Rule(0, MAX_COUNT, STEPS_FIX, low_open=True, fraction=True, strategy="logging_strategy"),
    "eval_steps": Rule(
        0,
        MAX_COUNT,
        STEPS_FIX + ", or leave it unset to evaluate every logging_steps",
        low_open=True,
        fraction=True,
        strategy="eval_strategy",
    ),
    "save_steps": Rule(0, MAX_COUNT, STEPS_FIX, low_open=True, fraction=True, strategy="save_strategy"),
    "eval_delay": Rule(0, MAX_COUNT, "give 0 to evaluate from the start, or the epochs or steps to wait first"),
    "eval_accumulation_steps": Rule(1, INF, "give a positive number of steps, or leave it unset"),
    "save_total_limit": Rule(1, INF, "keep at least 1 checkpoint, or leave it unset to keep them all"),
    "seed": Rule(0, SEED_MAX, f"give a seed from 0 to {SEED_MAX}"),
    "data_seed": Rule(0, SEED_MAX, f"give a seed from 0 to {SEED_MAX}, or leave it unset to use seed"),
    "dataloader_num_workers": Rule(
        0,
        MAX_WORKERS,
        f"give 0 to load batches in the training process, or a number of worker processes ({WORKERS_BOUND})",
    ),
    "dataloader_prefetch_factor": Rule(1, INF, "give a positive number of batches per worker, or leave it unset"),
    "ddp_bucket_cap_mb": Rule(1, INF, "give a positive bucket size in MB, or leave it unset"),
    "ddp_timeout": Rule(1, INF, "give the collectives' timeout in seconds, e.g. 1800"),
    "local_rank": Rule(0, INF, "leave it to the launcher (-1: not launched)", special=(-1,)),
}


# checked in each __post_init__
OWN_RULES = {**ModelArguments.RULES, **DataArguments.RULES, **RunArguments.RULES}


VALUE_RULES = {**TRAINING_RULES, **OWN_RULES}


# Numeric fields with no range of their own, on purpose (name -> why): checked as finite numbers only.
FINITE_ONLY: dict[str, str] = {}


# numeric_fields(), found once: the dataclasses do not change while we run
_numeric: dict[str, type] = {}


def numeric_fields() -> dict[str, type]:
    """Every int or float field (None allowed or not) of the dataclasses parse_args builds, by name: int or float."""
    import typing

    if not _numeric:
        for cls in (ModelArguments, DataArguments, RunArguments, TrainingArguments):
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                # bool is its own type, not in {int, float}
                kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
                if f.init and kinds & {int, float}:
                    _numeric[f.name] = float if float in kinds else int
    return dict(_numeric)


def value_problem(name: str, value, raw=None) -> str | None:
    """rules.problem with the field's rule from VALUE_RULES."""
    return problem(name, value, VALUE_RULES.get(name), raw)


def check_value_ranges(raw) -> None:
    """Every numeric TrainingArguments field parse_args gives, against its rule: one line naming the first that is
    out of range (the argument dataclasses check theirs, rules.check)."""
    for name in numeric_fields():
        if name not in OWN_RULES and (why := value_problem(name, getattr(raw, name, None), raw)):
            raise RecipeError(why)


def warn_long_warmup(warmup_steps: float, total_steps: int, learning_rate: float) -> None:
    """Legitimate (a learning-rate range test warms up over the whole run) but rarely meant: said, not refused."""
    if warmup_steps >= total_steps:
        say(
            f"warning: warmup_steps={shown(warmup_steps)} covers the whole run of {total_steps} optimizer steps: "
            f"the learning rate never reaches learning_rate={shown(learning_rate)}"
        )


def batches_per_process(examples: int, batch_size: int, processes: int, drop_last: bool = False) -> int:
    """Micro-batches one process draws in an epoch of ``examples``: the Trainer batches the dataset and accelerate
    deals the batches out to the data-parallel processes (even_batches, its default: a process left short wraps
    around to the first batches; with drop_last the incomplete batch and round are dropped instead)."""
    if drop_last:
        return examples // batch_size // processes
    # ceil(ceil(examples / batch_size) / processes), in integers
    batches = -(-examples // batch_size)
    return -(-batches // processes)


def steps_per_epoch(batches: int, accumulation: int) -> int:
    """Optimizer steps an epoch gives, as the Trainer counts them (transformers 5.23,
    Trainer.set_initial_training_values): a last, shorter accumulation is a step of its own; at least 1."""
    return max(-(-batches // accumulation), 1)


def check_run_length(args, examples: int, profile_steps: str | None = None) -> int:
    """The checks that need the training set's size (train_fsdp.py, once it is built, before the Trainer is):
    an accumulation longer than an epoch, a profile past the run's end, a warmup as long as the run. ``args``:
    TrainingArguments, or anything with its fields and world_size (every process is data-parallel here: no
    tensor or context parallelism). Returns the run's optimizer steps."""
    import math

    size, processes, accumulation = args.per_device_train_batch_size, args.world_size, args.gradient_accumulation_steps
    batches = batches_per_process(examples, size, processes, args.dataloader_drop_last)
    source = (
        f"{examples:,} examples / (per_device_train_batch_size={size} x {processes} "
        f"process{'es' if processes > 1 else ''})"
    )
    if batches == 0:
        raise RecipeError(
            f"per_device_train_batch_size={size} leaves no batch with dataloader_drop_last ({source}): "
            "lower per_device_train_batch_size, drop dataloader_drop_last, or give more data"
        )
    # every optimizer step would average `batches` micro-batches, not `accumulation`
    if batches < accumulation:
        raise RecipeError(
            f"gradient_accumulation_steps={accumulation} is more than the {batches} micro-batch"
            f"{'es' if batches > 1 else ''} an epoch gives each process ({source}): every optimizer step "
            f"would average {batches} instead of {accumulation}: use gradient_accumulation_steps {batches} "
            "or less, a smaller per_device_train_batch_size, or more data"
        )
    per_epoch = steps_per_epoch(batches, accumulation)
    epoch_based = args.max_steps <= 0
    total = math.ceil(args.num_train_epochs * per_epoch) if epoch_based else args.max_steps
    length = (
        f"num_train_epochs={shown(args.num_train_epochs)} x {per_epoch} steps an epoch"
        if epoch_based
        else f"max_steps={args.max_steps}"
    )
    if profile_steps:
        first, last = parse_steps(str(profile_steps))
        if last > total:
            # as many steps, ending with the run
            start = max(1, total - (last - first))
            raise RecipeError(
                f"profile_steps={profile_steps} ends after the run's {total} optimizer steps ({length}): "
                f"profile steps within the run, e.g. {start}-{total}"
            )
    # with max_steps, parse_args has warned already
    if epoch_based and args.warmup_steps >= 1:
        warn_long_warmup(args.warmup_steps, total, args.learning_rate)
    return total


def parse_steps(text: str) -> tuple[int, int]:
    """'5-8' (optimizer steps, inclusive, counted from 1) or '5' -> (first, last)."""
    first, _, last = text.partition("-")
    first, last = int(first), int(last or first)
    if not 1 <= first <= last:
        raise ValueError(f"{text!r}: give the first and last optimizer step to profile, e.g. 5-8 (counted from 1)")
    return first, last
