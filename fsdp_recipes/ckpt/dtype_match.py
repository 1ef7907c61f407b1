"""Would a resume round a checkpoint's tensors: the dtypes the checkpoint records against the dtypes this run holds
its parameters (and so its optimizer state) in, decided before anything loads.

A weight loaded into a parameter of another dtype is cast without a word, by DCP's load and by load_state_dict: into
a wider float the cast is exact (a bf16 run resumed in fp32 goes on from the same values), into a narrower or the
other 16-bit float every value is rounded, and the run does not go on as it was. What the checkpoint records: the
dtype of every weight it stores (DCP metadata, safetensors headers), and for the weights it does not store (a LoRA
checkpoint's frozen base, which the run loads from its model source) the dtype its run loaded the model in: its
config.json's ``dtype``, else what else the run recorded (run_args.json's --dtype, the base model's config.json),
else nothing, and the base is not compared (see ``recorded_base_dtype``). What this run holds is declared before
the first step (fsdp_recipes.train.optimizer's held_dtypes: --dtype, and FSDP mixed precision's fp32 master weights),
not read from the prepared model, so the verdict is the same on every CPU and GPU that runs with the same settings.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.layout import ADAPTER_CONFIG, RUN_RECORD
from fsdp_recipes.errors import UnreadableFile

# the dtypes each float dtype casts into exactly (itself and the wider floats); nothing else is a weight rounded here
EXACT_INTO = {
    "float64": {"float64"},
    "float32": {"float32", "float64"},
    "bfloat16": {"bfloat16", "float32", "float64"},
    "float16": {"float16", "float32", "float64"},
}


def rounds(saved: str | None, held: str | None) -> bool:
    """A tensor saved as ``saved`` loses precision when loaded into one held as ``held``. Dtypes other than the four
    floats (an integer step count, 4-bit storage, a name no torch has) are never called rounded here."""
    return saved in EXACT_INTO and held in EXACT_INTO and held not in EXACT_INTO[saved]


def narrowed(
    saved: dict[str, str], held: dict[str, str], frozen: set[str], base: str | None
) -> tuple[str, str, str] | None:
    """The first parameter (by name) a resume would round, as (name, dtype recorded, dtype held); None when none.
    ``saved``: name -> dtype of each weight the checkpoint stores; ``held``: name -> dtype this run holds each
    parameter in; ``frozen``: the parameters it does not train; ``base``: the dtype the checkpoint's run loaded its
    model in (None: not recorded), compared for the frozen parameters the checkpoint does not store."""
    for name in sorted(held):
        recorded = saved.get(name, base if name in frozen else None)
        if rounds(recorded, held[name]):
            return name, recorded, held[name]
    return None


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; {} when there is none to read (absent, unreadable, not an object)."""
    try:
        return load_json(path, path.name, JSON_LIMIT) if path.is_file() else {}
    except UnreadableFile:
        return {}


def _float_dtype(config: dict) -> str | None:
    """config.json's ``dtype`` (``torch_dtype`` before transformers 4.56), when it is one of the floats."""
    value = config.get("dtype", config.get("torch_dtype"))
    return value if isinstance(value, str) and value in EXACT_INTO else None


def _base_config_dtype(name: object) -> str | None:
    """The float dtype in the config.json of base model ``name`` (a local folder, or the hub cache's copy: never
    downloaded); None when there is none to read."""
    from fsdp_recipes.ckpt.base_identity import local_folder

    if not isinstance(name, str) or not name:
        return None
    try:
        folder = local_folder(name)
    # a name no filesystem can look up (a NUL byte)
    except (OSError, ValueError):
        return None
    return _float_dtype(_json_object(folder / "config.json")) if folder is not None else None


def recorded_base_dtype(ckpt: Path) -> tuple[str, str] | None:
    """The dtype the checkpoint's run loaded its model in, and where that is recorded, when it is one of the floats:
    the checkpoint's config.json; else its run's --dtype in the run_args.json beside it; else (--dtype auto, or no
    run record) the config.json of the base model that run, or the checkpoint's adapter_config.json, names. None when
    none of them records one (another tool's checkpoint, a hostile value): the base is then not compared.
    Unreadable files are named by the description check, not here."""
    if (dtype := _float_dtype(_json_object(ckpt / "config.json"))) is not None:
        return dtype, "its config.json's dtype"
    model = _json_object(ckpt.parent / RUN_RECORD).get("model")
    model = model if isinstance(model, dict) else {}
    requested = model.get("dtype", "auto")
    if isinstance(requested, str) and requested in EXACT_INTO:
        return requested, f"--dtype in its run's {RUN_RECORD}"
    # a value no run of ours records: nothing to go by
    if requested != "auto":
        return None
    for name in (model.get("model_name_or_path"), _json_object(ckpt / ADAPTER_CONFIG).get("base_model_name_or_path")):
        if (dtype := _base_config_dtype(name)) is not None:
            return dtype, f"the dtype in its base model's config.json ({name})"
    return None


def dtype_mismatch(ckpt: str | os.PathLike, held: dict[str, str], frozen: set[str] = frozenset()) -> str | None:
    """Why resuming ``ckpt`` into this run's parameters would round its weights or its optimizer state, in one line;
    None when every value loads exactly. ``held``: name -> dtype this run holds each parameter in (the model's own
    names, before FSDP wraps it); ``frozen``: the names it does not train (see ``narrowed``)."""
    from fsdp_recipes.ckpt.model_match import stored_tensors
    from fsdp_recipes.ckpt.namespace import clean_name

    ckpt = Path(ckpt)
    stored = stored_tensors(ckpt) or {}
    saved = {name: dtype for name, (_, dtype) in stored.items()}
    held = {clean_name(k): v for k, v in held.items()}
    frozen = {clean_name(k) for k in frozen}
    base, source = recorded_base_dtype(ckpt) or (None, None)
    found = narrowed(saved, held, frozen, base)
    if found is None:
        return None
    name, was, now = found
    if name in saved:
        return (
            f"{ckpt} holds {was} weights and this run's parameters are {now} (--dtype, or the accelerate config's "
            f"mixed precision; e.g. {name}): loading would round every weight and its optimizer state to {now}, "
            f"and the run would not go on as it was; resume with --dtype {was} (the dtype it was trained with), or "
            f"merge it (tools/merge_checkpoint.py --dtype {now}) and start a new run from the merged model"
        )
    return (
        f"{ckpt} was trained on its base model's weights in {was} ({source}) and this run loads them "
        f"in {now} (--dtype; e.g. {name}): the adapter would go on training over rounded base weights, and the run "
        f"would not go on as it was; resume with --dtype {was} (the dtype it was trained with), or start a new run "
        "without --resume_from_checkpoint"
    )
