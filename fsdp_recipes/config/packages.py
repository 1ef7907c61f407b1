"""Options whose value needs a package this repository does not install (--optim adamw_8bit: bitsandbytes;
--report_to wandb; --attn_implementation flash_attention_2; --use_liger_kernel): transformers imports the package
only once the model or the Trainer is built, so a missing one is a traceback on every rank after start-up. Here
each is one line in parse_args, before anything launches. Packages are found (importlib.util.find_spec, or
transformers' own is_*_available, which also checks the version it needs), never imported."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from fsdp_recipes.compat import internals
from fsdp_recipes.errors import RecipeError


@dataclass(frozen=True)
class Need:
    """A package an option's value needs: ``install`` is what pip installs (or how to get it), ``module`` what
    import finds; ``helper`` names transformers.utils' check where it has one (a version, a device): that check
    decides, since it is the one transformers applies before it imports."""

    install: str
    module: str
    helper: str | None = None
    helper_args: tuple = ()
    # the device the helper also wants (flash attention: CUDA), named when it is missing
    device: str | None = None


def _pip(name: str) -> str:
    return f"pip install {name}"


# --optim: by the transformers function that builds the optimizer (transformers.trainer_optimizer's dispatch), so
# every OptimizerNames value that shares it (15 bitsandbytes variants, 6 GaLore ...) is covered, and an optimizer a
# newer transformers adds lands in a known group or in none (tests/unit/config/test_packages.py fails for the latter).
OPTIMIZER_BUILDERS: dict[str, Need | None] = {
    "_get_adafactor": None,
    "_get_adamw_torch": None,
    "_get_sgd": None,
    "_get_adagrad": None,
    "_get_rmsprop": None,
    "_get_bitsandbytes_optimizer": Need(_pip("bitsandbytes"), "bitsandbytes", "is_bitsandbytes_available"),
    "_get_galore_optimizer": Need(_pip("galore-torch"), "galore_torch", "is_galore_torch_available"),
    "_get_apollo_optimizer": Need(_pip("apollo-torch"), "apollo_torch", "is_apollo_torch_available"),
    "_get_lomo_optimizer": Need(_pip("lomo-optim"), "lomo_optim", "is_lomo_available"),
    "_get_grokadamw": Need(_pip("grokadamw"), "grokadamw", "is_grokadamw_available"),
    "_get_torchao_optimizer": Need(_pip("torchao"), "torchao", "is_torchao_available"),
    "_get_schedule_free_optimizer": Need(_pip("schedulefree"), "schedulefree", "is_schedulefree_available"),
    "_get_stable_adamw": Need(_pip("torch-optimi"), "optimi", "is_torch_optimi_available"),
    "_get_adamw_anyprecision": Need(
        "pip install git+https://github.com/pytorch/torchdistx", "torchdistx", "is_torchdistx_available"
    ),
    "_get_adamw_torch_xla": Need(_pip("torch_xla"), "torch_xla", "is_torch_xla_available"),
    "_get_adamw_torch_npu_fused": Need(_pip("torch_npu"), "torch_npu", "is_torch_npu_available"),
}


# one optimizer of a group that needs a newer release than its builder checks for (transformers raises later)
OPTIMIZER_OVERRIDES = {
    "schedule_free_radam": Need(_pip("'schedulefree>=1.4.0'"), "schedulefree", "is_schedulefree_available", ("1.4.0",)),
}


# --report_to: transformers.integrations' names. Its is_wandb_available imports wandb and is_comet_available also
# wants an API key, so presence is found here directly; each alternative is enough (tensorboard or tensorboardX).
REPORTERS: dict[str, tuple[Need, ...]] = {
    "azure_ml": (Need(_pip("azureml-sdk"), "azureml"),),
    "comet_ml": (Need(_pip("comet-ml"), "comet_ml"),),
    "mlflow": (Need(_pip("mlflow"), "mlflow"),),
    "neptune": (Need(_pip("neptune"), "neptune"),),
    "tensorboard": (Need(_pip("tensorboard"), "tensorboard"), Need(_pip("tensorboardX"), "tensorboardX")),
    "trackio": (Need(_pip("trackio"), "trackio"),),
    "wandb": (Need(_pip("wandb"), "wandb"),),
    "codecarbon": (Need(_pip("codecarbon"), "codecarbon"),),
    "clearml": (Need(_pip("clearml"), "clearml"),),
    "dagshub": (Need(_pip("dagshub mlflow"), "dagshub"),),
    "flyte": (Need(_pip("flytekit flytekitplugins-deck-standard"), "flytekit"),),
    "dvclive": (Need(_pip("dvclive"), "dvclive"),),
    "swanlab": (Need(_pip("swanlab"), "swanlab"),),
    # no package: a Kubeflow TrainJob's environment (KUBEFLOW_TRAINER_SERVER_URL)
    "kubeflow": (),
}
# DagsHub logs through MLflow
REPORTER_ALSO = {"dagshub": Need(_pip("mlflow"), "mlflow")}


FLASH = "a CUDA GPU (transformers' flash attention kernels run on GPUs only)"
ATTENTION: dict[str, Need] = {
    "flash_attention_2": Need(
        _pip("flash-attn --no-build-isolation"), "flash_attn", "is_flash_attn_2_available", device=FLASH
    ),
    "flash_attention_3": Need(
        "flash-attn-3, built from the hopper/ folder of github.com/Dao-AILab/flash-attention",
        "flash_attn_interface",
        "is_flash_attn_3_available",
        device=FLASH,
    ),
    "flash_attention_4": Need(_pip("flash-attn-4"), "flash_attn", "is_flash_attn_4_available", device=FLASH),
    "flex_attention": Need(_pip("'torch>=2.5'"), "torch", "is_torch_flex_attn_available"),
}
# Liger's kernels are Triton: installed without a GPU they fail on every rank at the model's patching
LIGER = Need(
    "pip install -r requirements-gpu.txt",
    "liger_kernel",
    "is_liger_kernel_available",
    device="a CUDA GPU (Liger's kernels are Triton kernels)",
)


def found(need: Need) -> bool:
    """Whether transformers will find ``need`` as it checks: its helper where there is one, else the module."""
    if need.helper is not None:
        import transformers.utils

        if (helper := getattr(transformers.utils, need.helper, None)) is not None:
            return bool(helper(*need.helper_args))
    return module_found(need.module)


def module_found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    # a broken install, or a module without a spec
    except (ImportError, ValueError):
        return False


def missing(option: str, need: Need, instead: str) -> str:
    """The one line for ``option`` (as it is written, e.g. optim=adamw_8bit), whose ``need`` is not met."""
    # installing the package would not help
    if need.device is not None and not _cuda():
        return f"{option} needs {need.device}, and this machine has none: {instead}"
    if module_found(need.module):
        upgrade = need.install.replace("pip install ", "pip install -U ", 1)
        return (
            f"{option}: the {need.module} package is installed but is not a release transformers accepts (too old, "
            f"or another distribution of it): {upgrade}, or {instead}"
        )
    return f"{option} needs the {need.module} package, which is not installed: {need.install}, or {instead}"


def optimizer_need(name: str) -> Need | None:
    """What ``--optim name`` needs, from the transformers function that builds it (None: torch alone)."""
    if name in OPTIMIZER_OVERRIDES:
        return OPTIMIZER_OVERRIDES[name]
    try:
        from transformers.training_args import OptimizerNames

        builder = internals.get("transformers.trainer_optimizer._OPTIMIZER_HANDLERS")[OptimizerNames(name)]
    # another transformers: its own error, later
    except (ImportError, KeyError, ValueError):
        return None
    return OPTIMIZER_BUILDERS.get(getattr(builder, "__name__", ""))


def optim_args_problem(optim: str, optim_args: str | None) -> str | None:
    """--optim_args that transformers would stop on (an item without one '=': a ValueError on every rank when the
    Trainer builds its optimizer) or drop without a word: the builder of --optim never reads them (AdamW's: its
    settings are adam_beta1, adam_beta2, adam_epsilon, weight_decay). Judged from that builder's own source."""
    import inspect

    if not optim_args or not str(optim_args).strip():
        return None
    bad = [item for item in str(optim_args).replace(" ", "").split(",") if item.count("=") != 1]
    if bad:
        return f"optim_args={optim_args!r}: {', '.join(bad)} is not key=value: write key=value,key=value"
    try:
        from transformers.training_args import OptimizerNames

        handlers = internals.get("transformers.trainer_optimizer._OPTIMIZER_HANDLERS")
        # no package to add
        reads = {
            name.value
            for name, builder in handlers.items()
            if "optim_args" in inspect.getsource(builder) and optimizer_need(name.value) is None
        }
        if "optim_args" in inspect.getsource(handlers[OptimizerNames(optim)]):
            return None
    # another transformers, or no source: not judged
    except (ImportError, KeyError, ValueError, OSError, TypeError):
        return None
    adamw = " (AdamW's settings are adam_beta1, adam_beta2, adam_epsilon, weight_decay)" if "adam" in optim else ""
    return (
        f"optim_args={optim_args!r} would be ignored: transformers' builder of optim={optim} never reads it{adamw}: "
        f"drop optim_args, or use an optimizer that takes it ({', '.join(sorted(reads))})"
    )


def reporters(value) -> list[str]:
    """report_to as names: a flag gives one, a recipe one or a list (TrainingArguments splits no "a,b")."""
    names = value if isinstance(value, (list, tuple)) else [value]
    return [str(n).strip() for n in names if n is not None and str(n).strip()]


def report_to_problem(value) -> str | None:
    import os

    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    for name in reporters(value):
        # all: the installed ones, by definition
        if name in ("all", "none"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            return (
                f"report_to={name!r} is not an integration transformers reports to: give one of "
                f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}, all or none"
            )
        if name == "kubeflow":
            if not os.environ.get("KUBEFLOW_TRAINER_SERVER_URL"):
                return (
                    "report_to=kubeflow reports to the Kubeflow TrainJob this runs in, and there is none "
                    "(KUBEFLOW_TRAINER_SERVER_URL is not set): drop kubeflow from report_to"
                )
            continue
        needs = REPORTERS.get(name)
        if needs and not any(found(n) for n in needs):
            return missing(f"report_to={name}", needs[0], f"drop {name} from report_to")
        if (also := REPORTER_ALSO.get(name)) is not None and not found(also):
            return missing(f"report_to={name}", also, f"drop {name} from report_to")
    return None


def attention_problem(value: str | None) -> str | None:
    if not value:
        return None
    # a hub kernel (kernels-community/flash-attn): transformers loads it with the kernels package
    if "/" in value:
        if module_found("kernels"):
            # whether the hub has it is the load's to say
            return None
        return (
            f"attn_implementation={value!r} is a kernel from the hub, which transformers loads with the kernels "
            "package, not installed here: pip install kernels, or use --attn_implementation sdpa"
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = value.removeprefix("paged|")
    known = ["eager", *(k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if "|" not in k)]
    if name not in known:
        return f"attn_implementation={value!r} is not one of {', '.join(known)}: give one, e.g. sdpa"
    need = ATTENTION.get(name)
    if need is None or found(need):
        return None
    if need.device is not None and module_found("kernels") and _cuda():
        # transformers loads the kernels hub's build of it instead
        return None
    return missing(f"attn_implementation={value}", need, "use --attn_implementation sdpa (or leave it unset)")


def _cuda() -> bool:
    from transformers.utils import is_torch_cuda_available

    return is_torch_cuda_available()


def check_deepspeed(value) -> None:
    """TrainingArguments' deepspeed (a file or, in a recipe, a mapping) would start DeepSpeed instead of FSDP."""
    if value:
        shown = "a DeepSpeed config mapping" if isinstance(value, dict) else f"{value!r}"
        raise RecipeError(
            f"deepspeed={shown}: this repository trains with FSDP, not DeepSpeed: drop deepspeed and launch "
            "with an FSDP accelerate config (accelerate_configs/zero3.yaml is ZeRO-3's equivalent, zero2.yaml "
            "ZeRO-2's)"
        )


def check_packages(raw) -> None:
    """Every option of the run whose value needs a package transformers will not find, as one line, before any
    process group starts; and the deepspeed key, which has no place in an FSDP run."""
    check_deepspeed(getattr(raw, "deepspeed", None))
    optim = getattr(raw, "optim", None)
    optim = str(getattr(optim, "value", optim)) if optim is not None else None
    if optim and (need := optimizer_need(optim)) is not None and not found(need):
        raise RecipeError(missing(f"optim={optim}", need, "use --optim adamw_torch"))
    if optim and (problem := optim_args_problem(optim, getattr(raw, "optim_args", None))):
        raise RecipeError(problem)
    if problem := report_to_problem(getattr(raw, "report_to", None)):
        raise RecipeError(problem)
    if problem := attention_problem(getattr(raw, "attn_implementation", None)):
        raise RecipeError(problem)
    if getattr(raw, "use_liger_kernel", False) and not (found(LIGER) and _cuda()):
        raise RecipeError(missing("use_liger_kernel=true", LIGER, "drop use_liger_kernel"))
