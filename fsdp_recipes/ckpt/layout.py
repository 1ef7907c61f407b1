"""Names and layout of the checkpoints the tools read and training writes. Imports nothing beyond the standard
library: training code, tools/check_checkpoint.py and the merge all start from here, and none of them should pay
for torch or transformers to learn a file name."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fsdp_recipes.bounded import REPORT_LIMIT, load_json
from fsdp_recipes.errors import UnreadableFile
from fsdp_recipes.removal import MARKER, fingerprint, is_ours

# accelerate's sharded model folder in a checkpoint-N
DCP_MODEL_DIR = "pytorch_model_fsdp_0"
OPTIMIZER_DIR = "optimizer_0"
# accelerate's FULL_STATE_DICT model
FULL_MODEL_FILE = "pytorch_model_fsdp.bin"
FULL_OPTIMIZER_FILE = "optimizer.bin"
FULL_FILES = ("model.safetensors.index.json", "model.safetensors", FULL_MODEL_FILE)
# the Trainer's own layout without FSDP (DDP, ZeRO-1 consolidated, one process)
PLAIN_OPTIMIZER_FILE = "optimizer.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# peft
ADAPTER_CONFIG = "adapter_config.json"
# a LoRA run's base model, recorded in its checkpoints and adapter (ckpt.base_identity)
BASE_IDENTITY = "base_identity.json"
# a LoRA run's base built from a config, saved once in its output_dir: the adapter names it
LORA_BASE_DIR = "base_model"
# a run's final model, alone in its folder: what from_pretrained and an upload need
FINAL_MODEL_DIR = "model"
# a LoRA run's adapter, beside it: PeftModel.from_pretrained loads it
ADAPTER_DIR = "adapter"
# the proof of sharding, per run and per checkpoint (fsdp_recipes.train.sharding)
REPORT_NAME = "fsdp_report.json"
# each .distcp file's size and sample hash, written once every rank is done
SHARD_DIGESTS = "shard_digests.json"
# written into each checkpoint by the training run (fsdp_recipes.ckpt.description)
MANIFEST = "model_description.json"
# outside the Trainer's `checkpoint-*` glob: never rotated, never resumed
INCOMPLETE_PREFIX = "incomplete-"
# a checkpoint of a step a resumed run trains again (another branch of the run)
REPLACED_PREFIX = "replaced-"
# FSDP1, torch.compile and activation checkpointing put these inside parameter names
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def step_of_name(folder: str | os.PathLike) -> int | None:
    """N of a folder named checkpoint-N (None for any other name)."""
    found = re.fullmatch(r"checkpoint-(\d+)", Path(folder).name)
    return int(found.group(1)) if found else None


def checkpoint_steps(run_dir: Path) -> list[Path]:
    """A run folder's checkpoint-N folders, newest first."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if p.is_dir() and step_of_name(p) is not None]
    return sorted(found, key=step_of_name, reverse=True)


def final_model_folder(run_dir: str | os.PathLike) -> Path | None:
    """Where a run's final model is: ``run_dir/model/`` (written since the model got a folder of its own), or
    ``run_dir`` itself for a run an earlier version wrote (config.json beside the checkpoints); None before a run
    ends."""
    run_dir = Path(run_dir)
    for folder in (run_dir / FINAL_MODEL_DIR, run_dir):
        if (folder / "config.json").is_file() and any(
            (folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
        ):
            return folder
    return None


def training_content(folder: Path) -> str | None:
    """What in ``folder`` a training run or checkpoint would lose if the folder were replaced (None: nothing).
    Looks one level deep: a run folder holds checkpoint-N folders, a checkpoint holds shards and trainer state."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if steps := checkpoint_steps(folder):
        return f"training checkpoints ({steps[0].name}, ...)"
    for name in (
        DCP_MODEL_DIR,
        OPTIMIZER_DIR,
        "trainer_state.json",
        FULL_MODEL_FILE,
        FULL_OPTIMIZER_FILE,
        PLAIN_OPTIMIZER_FILE,
        ".metadata",
    ):
        if (folder / name).exists():
            return f"a training checkpoint ({name})"
    if (
        any(folder.glob("*.distcp"))
        or any(folder.glob(f"{INCOMPLETE_PREFIX}checkpoint-*"))
        or any(folder.glob(f"{REPLACED_PREFIX}checkpoint-*"))
    ):
        return "training checkpoint files"
    return None


# What each kind of folder we may replace holds, exactly (fsdp_recipes.removal removes nothing else): file names
# as patterns, and the subfolders whose own contents are checked the same way.
_DESCRIPTION_FILES = (
    r"config\.json",
    r"generation_config\.json",
    r"tokenizer(_config)?\.json",
    r"tokenizer\.model",
    r"special_tokens_map\.json",
    r"added_tokens\.json",
    r"vocab\.json",
    r"merges\.txt",
    r"chat_template\.(jinja|json)",
)
_WEIGHT_FILES = (r"model(-\d+-of-\d+)?\.safetensors", r"model\.safetensors\.index\.json")
# exactly what a merge or the final export writes
_EXPORTED_MODEL_FILES = (*_DESCRIPTION_FILES, *_WEIGHT_FILES)
_MODEL_FILES = (
    *_EXPORTED_MODEL_FILES,
    r"trainer_state\.json",
    r"adapter_config\.json",
    r"adapter_model(-\d+-of-\d+)?\.safetensors",
    r"adapter_model\.safetensors\.index\.json",
    r"base_identity\.json",
    r"\.made-by-fsdp-recipes",
)
_CHECKPOINT_FILES = (
    *_MODEL_FILES,
    r"training_args\.bin",
    r"scheduler\.pt",
    r"scaler\.pt",
    r"rng_state(_\d+)?\.pth",
    r"optimizer\.(pt|bin)",
    r"pytorch_model_fsdp(_\d+)?\.bin",
    r"model_description\.json",
    r"fsdp_report\.json",
    r"shard_digests\.json",
    # README.md: peft's model card, saved with a LoRA adapter
    r"README\.md",
    # the stock Trainer's other model files (save_safetensors false, BERT's and T5's tokenizers)
    r"pytorch_model(-\d+-of-\d+)?\.bin",
    r"pytorch_model\.bin\.index\.json",
    r"adapter_model\.bin",
    r"vocab\.txt",
    r"spiece\.model",
)
# __N.metadata: rank-local; .tmp: torch writes the metadata so, then renames it (a save killed between)
_DCP_FILES = (
    r"\.metadata",
    r"__\d+\.metadata",
    r"(__\d+)?\.metadata\.tmp",
    r"__\d+_\d+\.distcp",
    r"\.made-by-fsdp-recipes",
)
_CHECKPOINT_FOLDERS = {r"pytorch_model_fsdp_\d+": _DCP_FILES, r"optimizer_\d+": _DCP_FILES}


def _only(folder: Path, files: tuple[str, ...], folders: dict[str, tuple[str, ...]]) -> bool:
    """``folder`` is a real folder holding only regular files named by ``files`` and real subfolders named in
    ``folders``, which in turn hold only the files named there."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    for entry in folder.iterdir():
        if entry.is_symlink():
            return False
        if entry.is_dir():
            pattern = next((v for k, v in folders.items() if re.fullmatch(k, entry.name)), None)
            if pattern is None or not _only(entry, pattern, {}):
                return False
        elif not entry.is_file() or not any(re.fullmatch(p, entry.name) for p in files):
            return False
    return True


def is_model_folder(folder: Path) -> bool:
    """Only what a merge or the final export writes, the folder we may replace: weights and their index, config,
    generation config, tokenizer and chat template files; no subfolder (a trainer_state.json, an adapter, a notes.txt
    there are someone's)."""
    return _only(Path(folder), _EXPORTED_MODEL_FILES, {})


def unlike_model_folder(folder: Path) -> str:
    """The first entry of ``folder`` that makes it more than a model folder (for the one-line refusal)."""
    return _first_unlike(folder, _EXPORTED_MODEL_FILES)


# What a training run writes into its output_dir, beside the model files: checkpoints, set-aside ones, its records,
# tensorboard's runs/, profiles, the adapter, its lock and staging folders. Anything else there is someone's.
# (model|adapter).kept-N: a folder the export moved aside from its way, the user's, kept for them (removal.make_room).
# the final export's staging folders in output_dir: the gathered shards, the model folder, the adapter folder
FINAL_SHARDS, MODEL_STAGING, ADAPTER_STAGING = ".final-sharded", ".export-tmp", ".adapter-tmp"
EXPORT_FOLDERS = (FINAL_SHARDS, MODEL_STAGING, ADAPTER_STAGING)
_RUN_FOLDERS = (
    r"checkpoint-\d+",
    r"(model|adapter)\.kept-\d+",
    r"(incomplete|replaced)-checkpoint-\d+(\.\d+)?",
    FINAL_MODEL_DIR,
    ADAPTER_DIR,
    LORA_BASE_DIR,
    r"\.base-tmp",
    r"runs",
    r"profile",
    *(re.escape(name) for name in EXPORT_FOLDERS),
)
_RUN_FILES = (
    *_MODEL_FILES,
    r"run_args\.json",
    r"fsdp_report\.json",
    r"(all|train|eval)_results\.json",
    r"loss\.png",
    r"\.run\.lock",
    r"\.run\.lock\.owner",
    r"training_args\.bin",
    r"requeue_progress\.json",
)
_RUN_ENTRIES = (*_RUN_FILES, *_RUN_FOLDERS)
# the marker purpose of the final export's staging folders (fsdp_recipes.removal)
EXPORT_STAGING = "export staging"
# and of output_dir/.base-tmp (fsdp_recipes.train.modeling)
BASE_STAGING = "LoRA base staging"
# a run's staging folders in output_dir and the purpose their marker names: one of these names without it is someone's
# folder, which the run would refuse to remove only after training
STAGING_FOLDERS = {**dict.fromkeys(EXPORT_FOLDERS, EXPORT_STAGING), ".base-tmp": BASE_STAGING}


# A finished run's records and top-level model files, which other tools (the stock Trainer's run_clm.py, TRL) write
# under the same names: ours only beside the run_args.json every run of ours writes before anything else
_SHARED_RECORDS = (
    *_MODEL_FILES,
    r"(all|train|eval)_results\.json",
    r"training_args\.bin",
    r"fsdp_report\.json",
    r"loss\.png",
)
# written by fsdp_recipes.train.preflight (its ARGS_NAME)
RUN_RECORD = "run_args.json"


def another_tools_run(output_dir: Path) -> bool:
    """output_dir holds a finished run's records or model files, and no run_args.json: another tool's run."""
    # run_args.json in any form (a folder, a link, a FIFO) is not another tool's sign: foreign_entries names it itself
    return not os.path.lexists(Path(output_dir) / RUN_RECORD) and any(map(_shared_record, os.listdir(output_dir)))


def _shared_record(name: str) -> bool:
    return name != MARKER and any(re.fullmatch(r, name) for r in _SHARED_RECORDS)


# how foreign_entries names one
HARD_LINK = "a hard link: writing it would change the other name's file too"


def foreign_entries(output_dir: Path) -> list[str]:
    """Names in a run's output_dir that no run writes (a home folder's .bashrc, a project's src/), links and hard
    links (a run would write through them), entries of a run's name that are not regular files or folders (a FIFO), and
    what makes ``model/`` or ``adapter/`` more than the export writes there (the
    export replaces those folders): ``model/notes.txt``, ``adapter`` (a file). A finished run's records and model
    files without our run_args.json beside them are another tool's (a stock Trainer's trainer_state.json and
    all_results.json would be overwritten, merged into, or mixed with this run's). Sorted."""
    found = []
    theirs = another_tools_run(output_dir)
    for p in Path(output_dir).iterdir():
        if theirs and _shared_record(p.name) and p.is_file():
            found.append(p.name)
            continue
        if p.name == FINAL_MODEL_DIR and not is_model_folder(p):
            found.append(f"{p.name}/{unlike_model_folder(p)}" if p.is_dir() and not p.is_symlink() else p.name)
        elif p.name == ADAPTER_DIR and not is_exported_adapter(p):
            found.append(f"{p.name}/{unlike_adapter_folder(p)}" if p.is_dir() and not p.is_symlink() else p.name)
        elif p.name not in (FINAL_MODEL_DIR, ADAPTER_DIR) and (
            p.is_symlink() or not any(re.fullmatch(r, p.name) for r in _RUN_ENTRIES)
        ):
            found.append(p.name)
        # a FIFO named run_args.json: opening it would block the run for good
        elif not (p.is_file() or p.is_dir()):
            found.append(f"{p.name} (not a regular file or folder)")
        elif p.name in STAGING_FOLDERS and not is_ours(p, STAGING_FOLDERS[p.name]):
            found.append(f"{p.name} (named like a run's staging folder, but not one a run made)")
        # `cp -al run run.bak`: rewriting the record rewrites the backup's too
        elif p.is_file() and p.lstat().st_nlink > 1:
            found.append(f"{p.name} ({HARD_LINK})")
        # a folder named run_args.json: the write fails
        elif p.is_dir() != any(re.fullmatch(r, p.name) for r in _RUN_FOLDERS):
            found.append(
                f"{p.name} (a {'folder' if p.is_dir() else 'file'} where a run writes a "
                f"{'file' if p.is_dir() else 'folder'})"
            )
    return sorted(found)


_ADAPTER_FILES = (
    r"adapter_config\.json",
    r"adapter_model(-\d+-of-\d+)?\.safetensors",
    r"adapter_model\.safetensors\.index\.json",
    r"base_identity\.json",
)


def is_exported_adapter(folder: Path) -> bool:
    """A real folder holding only what an adapter export writes: adapter_config.json and adapter_model files."""
    return (Path(folder) / ADAPTER_CONFIG).is_file() and _only(Path(folder), _ADAPTER_FILES, {})


def is_adapter_file(name: str) -> bool:
    return any(re.fullmatch(p, name) for p in _ADAPTER_FILES)


def unlike_adapter_folder(folder: Path) -> str:
    """The first entry of ``folder`` that makes it more than an exported adapter (for the one-line refusal)."""
    return _first_unlike(folder, _ADAPTER_FILES) or f"(no {ADAPTER_CONFIG})"


def _first_unlike(folder: Path, files: tuple[str, ...]) -> str:
    for entry in sorted(Path(folder).iterdir()):
        if entry.is_symlink() or not entry.is_file() or not any(re.fullmatch(p, entry.name) for p in files):
            return entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else "")
    return ""


# the marker FSDPTrainer writes into each checkpoint-N it makes
CHECKPOINT_PURPOSE = "training checkpoint"
# What only training writes: a folder holding none of it (a model's or tokenizer's files alone) is no checkpoint.
# (not training_args.bin nor scaler.pt: the Trainer's save_model writes the first beside a plain model or adapter)
_TRAINING_STATE = (
    r"trainer_state\.json",
    r"pytorch_model_fsdp_\d+",
    r"optimizer_\d+",
    r"pytorch_model_fsdp(_\d+)?\.bin",
    r"optimizer\.(pt|bin)",
    r"rng_state(_\d+)?\.pth",
    r"scheduler\.pt",
)


def is_checkpoint_folder(folder: Path) -> bool:
    """Only what a training checkpoint holds (the Trainer's files, DCP shard folders, our description), and a
    checkpoint: made by this project (its marker), or holding some training state (an incomplete one counts: it is
    what --overwrite_output_dir is for). A folder of a user's files that merely carry a checkpoint's names (a
    README.md, a config.json, a saved model) is none; README.md (peft's model card) belongs only beside an adapter."""
    folder = Path(folder)
    if not _only(folder, _CHECKPOINT_FILES, _CHECKPOINT_FOLDERS):
        return False
    names = [entry.name for entry in folder.iterdir()]
    if "README.md" in names and ADAPTER_CONFIG not in names:
        return False
    return is_ours(folder, CHECKPOINT_PURPOSE) or any(re.fullmatch(p, name) for p in _TRAINING_STATE for name in names)


def _special_entry(entry: Path) -> str | None:
    """The name (NAME or NAME/INNER) of a pipe, device or socket at ``entry`` or directly inside a real folder there."""
    if entry.is_symlink():
        return None
    if not entry.is_dir():
        return None if entry.is_file() else entry.name
    return next(
        (
            f"{entry.name}/{inner.name}"
            for inner in sorted(entry.iterdir())
            if not inner.is_symlink() and not inner.is_dir() and not inner.is_file()
        ),
        None,
    )


def checkpoint_unlike(folder: Path) -> str | None:
    """None for a checkpoint holding nothing else (is_checkpoint_folder); else why not, for the one line that keeps
    it."""
    try:
        if is_checkpoint_folder(folder):
            return None
        entries = [] if folder.is_symlink() else sorted(folder.iterdir())
        for entry in entries:
            # a FIFO named trainer_state.json is no training state either
            if special := _special_entry(entry):
                return f"it holds {special}, which is not a regular file (a pipe, device or socket)"
            inner = next(
                (files for pattern, files in _CHECKPOINT_FOLDERS.items() if re.fullmatch(pattern, entry.name)), None
            )
            if (
                entry.is_symlink()
                or (entry.is_dir() and (inner is None or not _only(entry, inner, {})))
                or (not entry.is_dir() and not any(re.fullmatch(p, entry.name) for p in _CHECKPOINT_FILES))
            ):
                return (
                    f"it holds {entry.name}{'/' if entry.is_dir() and not entry.is_symlink() else ''}, which "
                    "a checkpoint does not"
                )
    # a colleague's 0700 folder, a stale NFS handle
    except OSError as err:
        return f"unreadable: {err.strerror}"
    if folder.is_symlink() or not entries:
        return "it is a link" if folder.is_symlink() else "it is empty"
    if (folder / "README.md").exists() and not (folder / ADAPTER_CONFIG).exists():
        return "it holds README.md, which a checkpoint holds only beside an adapter"
    return "it holds no training state, not even our marker"


def real(path: str | os.PathLike) -> Path:
    """The path with every symlink and `..` resolved, also when it does not exist yet."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def overlap(a: Path, b: Path) -> bool:
    """Real paths a and b are the same folder, or one holds the other."""
    return a == b or a in b.parents or b in a.parents


# What an export published, by identity: the final folders ship without our marker, so the run's fsdp_report.json
# keeps each one's device and inode ("published"); a model-shaped folder of the user's at that name is not ours.
PUBLISHED = "published"


def published(out: Path) -> dict:
    """{folder name: removal.fingerprint} of the final folders this output_dir's exports published ({} when unknown)."""
    try:
        record = load_json(Path(out) / REPORT_NAME, REPORT_NAME, REPORT_LIMIT).get(PUBLISHED)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def is_published(folder: Path) -> bool:
    """``folder`` is the very folder an export of its output_dir published (not one put in its place)."""
    made = fingerprint(folder)
    return made is not None and published(Path(folder).parent).get(Path(folder).name) == made


def record_published(out: Path, folder: Path, written: list | None) -> None:
    """The published folder's fingerprint in the run's fsdp_report.json (is_published), when the report exists (rank 0),
    and only while its entries are those the export ``written`` (removal.entries of its staging folder, taken before the
    rename): a file someone put there in the moment since is never recorded as ours (the folder is then kept aside by
    the next export, as anything not recorded is). A report no longer readable records nothing: the same safe side."""
    path = Path(out) / REPORT_NAME
    if path.is_file():
        try:
            report = load_json(path, REPORT_NAME, REPORT_LIMIT)
        except UnreadableFile:
            return
        earlier = report.get(PUBLISHED)
        record = {
            name: made for name, made in (earlier if isinstance(earlier, dict) else {}).items() if name != folder.name
        }
        made = fingerprint(folder)
        if written is not None and made is not None and made[3] == written:
            record[folder.name] = made
        report[PUBLISHED] = record
        path.write_text(json.dumps(report, indent=2) + "\n")
