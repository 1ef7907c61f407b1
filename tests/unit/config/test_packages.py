"""Options whose value needs a package (--optim adamw_8bit, --report_to wandb, --attn_implementation
flash_attention_2, --use_liger_kernel) are one line in parse_args when it is missing, not a traceback on every rank
after start-up; the deepspeed key is refused in an FSDP repository; a bare true/false flag means true (--packing
too, as in TRL), a flag that needs a value and has none says so; a ~ in a path is the home folder.

Packages are made found or missing by patching importlib.util.find_spec and transformers' is_*_available helpers,
so no case depends on what this machine has installed; the options this machine does have are run unpatched."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import transformers.utils
from conftest import REPO
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.training_args import OptimizerNames

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError

NO_FSDP = ("--allow_no_fsdp", "true")

# The packages the options below need: (module import finds, transformers.utils helper or None). Written out here,
# not read from fsdp_recipes.config.packages, so the cases stand on their own.
OPTIM_NEEDS = {
    **dict.fromkeys(
        [
            "adamw_bnb_8bit",
            "adamw_8bit",
            "ademamix",
            "ademamix_8bit",
            "lion_8bit",
            "lion_32bit",
            "paged_adamw_32bit",
            "paged_adamw_8bit",
            "paged_ademamix_32bit",
            "paged_ademamix_8bit",
            "paged_lion_32bit",
            "paged_lion_8bit",
            "rmsprop_bnb",
            "rmsprop_bnb_8bit",
            "rmsprop_bnb_32bit",
        ],
        ("bitsandbytes", "is_bitsandbytes_available"),
    ),
    **dict.fromkeys(
        [
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
        ],
        ("galore_torch", "is_galore_torch_available"),
    ),
    **dict.fromkeys(["apollo_adamw", "apollo_adamw_layerwise"], ("apollo_torch", "is_apollo_torch_available")),
    **dict.fromkeys(["lomo", "adalomo"], ("lomo_optim", "is_lomo_available")),
    **dict.fromkeys(
        ["schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"],
        ("schedulefree", "is_schedulefree_available"),
    ),
    **dict.fromkeys(["adamw_torch_4bit", "adamw_torch_8bit"], ("torchao", "is_torchao_available")),
    "grokadamw": ("grokadamw", "is_grokadamw_available"),
    "stable_adamw": ("optimi", "is_torch_optimi_available"),
    "adamw_anyprecision": ("torchdistx", "is_torchdistx_available"),
    "adamw_torch_xla": ("torch_xla", "is_torch_xla_available"),
    "adamw_torch_npu_fused": ("torch_npu", "is_torch_npu_available"),
}
TORCH_ONLY = {"adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"}
REPORT_MODULES = {
    "azure_ml": "azureml",
    "comet_ml": "comet_ml",
    "mlflow": "mlflow",
    "neptune": "neptune",
    "tensorboard": "tensorboard",
    "trackio": "trackio",
    "wandb": "wandb",
    "codecarbon": "codecarbon",
    "clearml": "clearml",
    "dagshub": "dagshub",
    "flyte": "flytekit",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
}
FLASH = {
    "flash_attention_2": ("flash_attn", "is_flash_attn_2_available"),
    "flash_attention_3": ("flash_attn_interface", "is_flash_attn_3_available"),
    "flash_attention_4": ("flash_attn", "is_flash_attn_4_available"),
}
LIGER = ("liger_kernel", "is_liger_kernel_available")
ALL_NEEDS = [
    *OPTIM_NEEDS.values(),
    *FLASH.values(),
    LIGER,
    *((m, None) for m in REPORT_MODULES.values()),
    ("tensorboardX", None),
    ("kernels", None),
]


@pytest.fixture
def packages(monkeypatch):
    """``packages(*modules, cuda=False)``: exactly these of ALL_NEEDS' modules are installed, seen through
    find_spec and through transformers' helpers alike; ``cuda``: whether transformers sees a CUDA GPU."""
    real = importlib.util.find_spec
    modules = {m for m, _ in ALL_NEEDS}

    def install(*present: str, cuda: bool = False):
        def find_spec(name, *args, **kwargs):
            if name.split(".")[0] in modules:
                return object() if name.split(".")[0] in present else None
            return real(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        for module, helper in ALL_NEEDS:
            if helper is not None:
                gpu = helper.startswith("is_flash_attn")
                monkeypatch.setattr(
                    transformers.utils,
                    helper,
                    lambda *a, _m=module, _gpu=gpu, **k: _m in present and (cuda or not _gpu),
                )
        monkeypatch.setattr(transformers.utils, "is_torch_cuda_available", lambda: cuda)

    return install


def run(tmp_path, *flags, recipe: str | None = None):
    argv = [*flags, "--output_dir", str(tmp_path / "out"), *NO_FSDP]
    if recipe is not None:
        path = tmp_path / "recipe.yaml"
        path.write_text(
            f"config_name: {REPO}/assets/tiny-llama\ntrain_file: {REPO}/assets/data/tiny_corpus.txt\n{recipe}"
        )
        argv.insert(0, str(path))
    return parse_args(argv)


def refused(tmp_path, *flags, recipe: str | None = None) -> str:
    with pytest.raises(RecipeError) as err:
        run(tmp_path, *flags, recipe=recipe)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_every_optimizer_is_decided():
    """A new OptimizerNames value must land in OPTIM_NEEDS or TORCH_ONLY (and in fsdp_recipes.config.packages)."""
    from fsdp_recipes.config.packages import OPTIMIZER_BUILDERS, optimizer_need

    assert set(OPTIM_NEEDS) | TORCH_ONLY == {o.value for o in OptimizerNames}
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS

    assert {h.__name__ for h in _OPTIMIZER_HANDLERS.values()} <= set(OPTIMIZER_BUILDERS)
    for name, (module, _) in OPTIM_NEEDS.items():
        assert optimizer_need(name).module == module, name
    assert all(optimizer_need(name) is None for name in TORCH_ONLY)


def test_every_helper_named_is_transformers():
    from fsdp_recipes.config import packages

    needs = [
        *filter(None, packages.OPTIMIZER_BUILDERS.values()),
        *packages.OPTIMIZER_OVERRIDES.values(),
        *packages.ATTENTION.values(),
        packages.LIGER,
    ]
    assert all(hasattr(transformers.utils, n.helper) for n in needs if n.helper)
    assert set(packages.REPORTERS) == set(INTEGRATION_TO_CALLBACK)


@pytest.mark.parametrize("optim", sorted(OPTIM_NEEDS))
def test_an_optimizer_without_its_package_is_one_line(optim, packages, tmp_path):
    module, _ = OPTIM_NEEDS[optim]
    packages()
    message = refused(tmp_path, "--optim", optim)
    assert (
        f"optim={optim}" in message
        and module in message
        and "pip install" in message
        and "--optim adamw_torch" in message
    )
    # a recipe key, the same line
    assert refused(tmp_path, recipe=f"optim: {optim}\n") == message
    packages(module)
    assert run(tmp_path, "--optim", optim)[2].raw.optim == optim


def test_an_installed_but_refused_package_says_upgrade(packages, tmp_path, monkeypatch):
    """bitsandbytes is there, but older than transformers accepts: install it again, upgraded."""
    packages("bitsandbytes")
    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda *a, **k: False)
    message = refused(tmp_path, "--optim", "adamw_8bit")
    assert "installed" in message and "pip install -U bitsandbytes" in message


@pytest.mark.parametrize("optim", sorted(TORCH_ONLY))
def test_torch_optimizers_need_nothing(optim, packages, tmp_path):
    packages()
    assert run(tmp_path, "--optim", optim)[2].raw.optim == optim


@pytest.mark.parametrize("name", sorted(REPORT_MODULES))
@pytest.mark.parametrize("how", ["flag", "recipe list", "recipe name"])
def test_a_reporting_integration_without_its_package_is_one_line(name, how, packages, tmp_path):
    module = REPORT_MODULES[name]
    given = {
        "flag": {"flags": ("--report_to", name)},
        "recipe list": {"recipe": f"report_to: [none, {name}]\n"},
        "recipe name": {"recipe": f"report_to: {name}\n"},
    }[how]
    packages()
    message = refused(tmp_path, *given.get("flags", ()), recipe=given.get("recipe"))
    assert (
        f"report_to={name}" in message and module in message and "pip install" in message and f"drop {name}" in message
    )
    # dagshub logs through mlflow
    packages(module, "mlflow")
    run(tmp_path, *given.get("flags", ()), recipe=given.get("recipe"))


def test_report_to_checks(packages, tmp_path, monkeypatch):
    packages("tensorboardX")
    # either package will do
    run(tmp_path, "--report_to", "tensorboard")
    packages("dagshub")
    assert "mlflow" in refused(tmp_path, "--report_to", "dagshub")
    for value in ("all", "none"):
        run(tmp_path, "--report_to", value)
    assert "wandb, all or none" in refused(tmp_path, "--report_to", "wandb,tensorboard")
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    assert "KUBEFLOW_TRAINER_SERVER_URL" in refused(tmp_path, "--report_to", "kubeflow")
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://trainer.example")
    run(tmp_path, "--report_to", "kubeflow")


@pytest.mark.parametrize("attn", sorted(FLASH))
def test_flash_attention_needs_its_package_and_a_gpu(attn, packages, tmp_path):
    module, _ = FLASH[attn]
    packages(module, cuda=False)
    message = refused(tmp_path, "--attn_implementation", attn)
    assert f"attn_implementation={attn}" in message and "CUDA GPU" in message and "sdpa" in message
    packages(cuda=True)
    message = refused(tmp_path, "--attn_implementation", attn)
    assert module in message and "not installed" in message and "sdpa" in message
    assert refused(tmp_path, recipe=f"attn_implementation: {attn}\n") == message
    packages(module, cuda=True)
    run(tmp_path, "--attn_implementation", attn)
    # transformers falls back to the kernels hub's build
    packages("kernels", cuda=True)
    run(tmp_path, "--attn_implementation", attn)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex_attention", "paged|eager"])
def test_attention_in_torch_needs_nothing(attn, packages, tmp_path):
    packages()
    assert run(tmp_path, "--attn_implementation", attn)[0].attn_implementation == attn


def test_an_unknown_attention_is_one_line(tmp_path):
    assert "is not one of eager" in refused(tmp_path, "--attn_implementation", "flash_attention")


@pytest.mark.parametrize("flags", [("--use_liger_kernel", "true"), ("--use_liger_kernel",)], ids=["true", "bare"])
def test_liger_without_its_package_or_a_gpu_is_one_line(flags, packages, tmp_path):
    """Liger's kernels are Triton: without CUDA, installed or not, the run is refused in one line (installed, every
    rank raised at the model's patching); with CUDA and without the package, the line names the pinned install."""
    for installed in ((), ("liger_kernel",)):
        packages(*installed)
        message = refused(tmp_path, *flags)
        assert "use_liger_kernel" in message and "needs a CUDA GPU (Liger's kernels are Triton" in message, message
    packages(cuda=True)
    message = refused(tmp_path, *flags)
    assert "liger_kernel package" in message and "pip install -r requirements-gpu.txt" in message, message
    packages("liger_kernel", cuda=True)
    assert run(tmp_path, *flags)[2].raw.use_liger_kernel is True
    packages()
    run(tmp_path, "--use_liger_kernel", "false")


@pytest.mark.parametrize(
    "given",
    [
        {"flags": ("--deepspeed", "ds.json")},
        {"recipe": "deepspeed: ds.json\n"},
        {"recipe": "deepspeed: {zero_optimization: {stage: 3}}\n"},
    ],
    ids=["flag", "recipe", "recipe mapping"],
)
def test_deepspeed_is_refused_for_an_fsdp_config(given, tmp_path):
    message = refused(tmp_path, *given.get("flags", ()), recipe=given.get("recipe"))
    assert message.startswith("deepspeed=") and "FSDP accelerate config" in message


def test_what_this_machine_has_passes_unpatched(tmp_path):
    """No patching: the options whose packages this repository installs (requirements.txt) pass."""
    for flags in (
        ("--optim", "adamw_torch"),
        ("--optim", "adamw_torch_fused"),
        ("--optim", "adafactor"),
        ("--report_to", "none"),
        ("--report_to", "all"),
        ("--attn_implementation", "sdpa"),
        ("--attn_implementation", "eager"),
        ("--use_liger_kernel", "false"),
    ):
        run(tmp_path, *flags)
    if importlib.util.find_spec("tensorboard") is not None:
        run(tmp_path, "--report_to", "tensorboard")
    for flags, module in (
        (("--optim", "adamw_8bit"), "bitsandbytes"),
        (("--report_to", "wandb"), "wandb"),
        (("--use_liger_kernel", "true"), "liger_kernel"),
    ):
        if importlib.util.find_spec(module) is None:
            assert module in refused(tmp_path, *flags)


# --- bare flags and missing values


def _true_false_flags():
    from transformers.hf_argparser import string_to_bool

    from fsdp_recipes.config.helptext import build_parser

    return sorted(
        {
            a.option_strings[0]
            for a in build_parser()._actions
            if a.nargs == "?" and a.const is True and getattr(a.type, "__wrapped__", None) is string_to_bool
        }
    )


@pytest.mark.parametrize("flag", _true_false_flags())
def test_a_bare_true_false_flag_means_true(flag):
    """Every HfArgumentParser bool flag alone reads as true, as with =true, and stays so when repeated with true."""
    from fsdp_recipes.config.flags import parse_flags
    from fsdp_recipes.config.helptext import build_parser
    from fsdp_recipes.config.trl_names import check_flag_aliases

    parser = build_parser()
    dest = flag.removeprefix("--")
    assert getattr(parse_flags(parser, [flag, "--seed", "1"])[0], dest) is True
    assert getattr(parse_flags(parser, [flag, "false"])[0], dest) is False
    check_flag_aliases([flag, flag, "true"], parser)
    with pytest.raises(RecipeError, match=f"^{flag} and {flag} false are given twice"):
        check_flag_aliases([flag, flag, "false"], parser)


# TRL's packing true takes chat data here
CHAT_DATA = ("--train_file", str(REPO / "assets" / "data" / "tiny_chat.jsonl"))


@pytest.mark.parametrize("flags", [("--use_peft",), ("--gradient_checkpointing",), ("--packing",)])
def test_bare_flags_at_the_end_or_before_another(flags, tmp_path):
    bare = run(tmp_path, *flags, "--seed", "3", *CHAT_DATA)
    last = run(tmp_path, "--seed", "3", *CHAT_DATA, *flags)
    explicit = run(tmp_path, *flags, "true", "--seed", "3", *CHAT_DATA)
    for got in (bare, last):
        assert (vars(got[0]), vars(got[1]), vars(got[2].raw)) == (
            vars(explicit[0]),
            vars(explicit[1]),
            vars(explicit[2].raw),
        )


def test_bare_packing_is_trls_true(tmp_path):
    assert (
        run(tmp_path, "--packing", *CHAT_DATA)[1].packing
        == run(tmp_path, "--packing", "true", *CHAT_DATA)[1].packing
        == "padding_free"
    )
    # the same value twice
    run(tmp_path, "--packing", "--packing", "true", *CHAT_DATA)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--max_steps", "2", "--max_steps"), "max_steps has no value: give a whole number after --max_steps"),
        (("--max_steps",), "max_steps has no value"),
        (("--learning_rate", "--seed", "1"), "learning_rate has no value: give a number"),
        (("--lr_scheduler_type",), "lr_scheduler_type has no value: give one of linear, cosine"),
        (("--resume_from_checkpoint",), "resume_from_checkpoint has no value: give true"),
        (("--lora_target_modules", "--use_peft"), "lora_target_modules has no value: give one or more values"),
        (("--report_to",), "report_to has no value: give a value after --report_to"),
        (("--output-dir",), "output_dir has no value: give the folder to write the run to after --output-dir"),
    ],
)
def test_a_flag_without_its_value_says_so(flags, message):
    with pytest.raises(RecipeError) as err:
        # no --output_dir after it: it would be read as the value
        parse_args([*NO_FSDP, *flags])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_value_flag_without_its_value_says_so():
    from fsdp_recipes.config.flags import parse_flags
    from fsdp_recipes.config.helptext import build_parser

    parser = build_parser()
    checked = 0
    for action in parser._actions:
        if action.nargs in (None, "+") and action.option_strings:
            for argv in ([action.option_strings[0]], [action.option_strings[0], "--seed", "1"]):
                with pytest.raises(RecipeError, match=f"^{action.dest} has no value: give .* after "):
                    parse_flags(parser, argv)
            checked += 1
    assert checked > 80


# --- ~ in paths


@pytest.fixture
def home(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    return home


def _no_tilde_folder():
    assert not Path("~").exists()


@pytest.mark.parametrize("value", ["~", "~/runs/a"])
def test_tilde_in_output_dir_is_the_home_folder(value, home):
    plan = parse_args(["--output_dir", value, "--overwrite_output_dir", "true", *NO_FSDP])[2]
    assert plan.raw.output_dir == os.path.expanduser(value) and plan.raw.output_dir.startswith(str(home))
    _no_tilde_folder()


def test_tilde_in_recipe_paths(home, tmp_path):
    shutil.copy(REPO / "assets" / "data" / "tiny_corpus.txt", home / "corpus.txt")
    shutil.copytree(REPO / "assets" / "tiny-llama", home / "tiny-llama")
    recipe = home / "r.yaml"
    recipe.write_text(
        "config_name: ~/tiny-llama\ntokenizer_name: ~/tiny-llama\ntrain_file: ~/corpus.txt\n"
        "output_dir: ~/out\nmax_steps: 2\n"
    )
    # quoted: no shell expanded it
    model_args, data_args, plan = parse_args(["~/r.yaml", *NO_FSDP])
    assert model_args.config_name == str(home / "tiny-llama") and model_args.tokenizer_name == str(home / "tiny-llama")
    assert data_args.train_file == str(home / "corpus.txt") and plan.raw.output_dir == str(home / "out")
    _no_tilde_folder()


def test_tilde_of_no_user_is_one_line(home):
    with pytest.raises(RecipeError, match="~no_such_user_here is no home folder here: give the full path"):
        parse_args(["--output_dir", "~no_such_user_here/run", *NO_FSDP])
    _no_tilde_folder()


@pytest.mark.parametrize("installed", [False, True])
def test_a_hub_kernel_as_attention_needs_the_kernels_package(installed, monkeypatch, tmp_path):
    """--attn_implementation kernels-community/flash-attn without the kernels package is one line before anything
    starts, not "kernels is either not installed" on every rank."""
    from fsdp_recipes.config import packages

    monkeypatch.setattr(packages, "module_found", lambda module: installed if module == "kernels" else True)
    said = packages.attention_problem("kernels-community/flash-attn")
    assert (said is None) if installed else ("pip install kernels" in said and "\n" not in said), said


# (optim, optim_args, a key whose value transformers' optimizer kwargs hold when it reads optim_args); the oracle is
# transformers' own Trainer.get_optimizer_cls_and_kwargs, not the rule under test
OPTIM_ARGS = [
    ("adamw_torch", "amsgrad=True", "amsgrad"),
    ("adamw_torch_fused", "amsgrad=True", "amsgrad"),
    ("adafactor", "scale_parameter=True", "scale_parameter"),
    ("sgd", "momentum=0.5", "momentum"),
    ("adagrad", "lr_decay=0.1", "lr_decay"),
    ("rmsprop", "momentum=0.5", "momentum"),
    ("adamw_torch", "eps=1e-3", "eps"),
]


@pytest.mark.parametrize("optim, optim_args, key", OPTIM_ARGS)
def test_optim_args_the_optimizer_would_ignore_are_refused(tmp_path, optim, optim_args, key):
    """transformers' AdamW builders never read optim_args: --optim_args amsgrad=True trained without amsgrad, without a
    word. Refused exactly where transformers' optimizer kwargs lack the value."""
    import torch
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "x"), optim=optim, optim_args=optim_args, report_to="none")
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, torch.nn.Linear(2, 2))
    value = optim_args.split("=", 1)[1]
    taken = key in kwargs and (
        str(kwargs[key]) == value or (not isinstance(kwargs[key], bool) and kwargs[key] == float(value))
    )
    if taken:
        run(tmp_path, "--optim", optim, "--optim_args", optim_args)
    else:
        assert f"optim_args={optim_args!r} would be ignored" in refused(
            tmp_path, "--optim", optim, "--optim_args", optim_args
        )


@pytest.mark.parametrize("optim_args", ["amsgrad", "a=1,b", "a=b=c"])
def test_optim_args_that_are_not_key_value_are_one_line(tmp_path, optim_args):
    assert "is not key=value" in refused(tmp_path, "--optim", "sgd", "--optim_args", optim_args)
