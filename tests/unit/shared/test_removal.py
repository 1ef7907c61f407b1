"""The deletion class: one module (fsdp_recipes/removal.py) deletes, replaces or moves paths, and only what this
project made (its marker) or what has an exact, documented shape. Generated: every tool that deletes, given
folders of every other kind, refuses in one line and leaves them as they were."""

from __future__ import annotations

import ast
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import FOREIGN, REPO, _checkpoint, _model_folder, _notes, _snapshot, cli

from fsdp_recipes.ckpt.layout import is_checkpoint_folder, is_model_folder
from fsdp_recipes.ckpt.merge import merge_checkpoint
from fsdp_recipes.ckpt.merge_output import remove_stale_staging
from fsdp_recipes.ckpt.resume import check_output_dir
from fsdp_recipes.ckpt.rotation import rotate, set_aside
from fsdp_recipes.errors import CheckpointError, RecipeError, RefusedRemoval
from fsdp_recipes.removal import MARKER, make_folder, remove, remove_inside
from fsdp_recipes.train.export import remove_export_leftovers

DELETING = {
    ("shutil", "rmtree"),
    ("shutil", "move"),
    ("os", "remove"),
    ("os", "unlink"),
    ("os", "rename"),
    ("os", "replace"),
    ("os", "rmdir"),
    ("os", "removedirs"),
    ("os", "renames"),
}
# Path methods no str or list has; Path.replace is checked by its arity
PATH_METHODS = {"unlink", "rmdir", "rename"}


def _deleting_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            found += [
                f"{path.name}:{node.lineno} from {node.module} import {a.name}"
                for a in node.names
                if (node.module, a.name) in DELETING
            ]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        if isinstance(owner, ast.Name) and (owner.id, name) in DELETING:
            found.append(f"{path.name}:{node.lineno} {owner.id}.{name}")
        # str.replace takes 2
        elif name in PATH_METHODS or (name == "replace" and len(node.args) == 1 and not node.keywords):
            found.append(f"{path.name}:{node.lineno} .{name}()")
    return found


def test_only_the_removal_module_deletes_or_moves():
    files = [
        *(REPO / "fsdp_recipes").rglob("*.py"),
        *(REPO / "tools").rglob("*.py"),
        *(REPO / "bench").rglob("*.py"),
        REPO / "train_fsdp.py",
    ]
    offenders = [hit for f in files if f.name != "removal.py" for hit in _deleting_calls(f)]
    assert offenders == [], "delete, replace or move only through fsdp_recipes/removal.py: " + ", ".join(offenders)
    # the scan finds what it looks for (it can fail)
    probe = REPO / "fsdp_recipes" / "removal.py"
    assert len(_deleting_calls(probe)) >= 4


@pytest.fixture
def merge_checkpoint_dir(trained) -> Path:
    """A real 2-rank FSDP2 checkpoint (only read)."""
    return trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12"


# Folders that are not ours, of every kind a careless command meets: each must survive every deleting path.


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_remove_refuses_what_we_did_not_make(tmp_path, kind):
    victim = tmp_path / "victim"
    FOREIGN[kind](victim)
    before = _snapshot(victim)
    for shape in (None, is_model_folder, is_checkpoint_folder):
        with pytest.raises(RefusedRemoval, match="refusing"):
            remove(victim, "merge staging", shape=shape)
    assert _snapshot(victim) == before


# a link to a model folder is replaced where it points and stays a link (test_merge.py): not foreign to a merge
@pytest.mark.parametrize("kind", sorted(set(FOREIGN) - {"link to a model"}))
def test_merge_overwrite_never_replaces_a_foreign_folder(merge_checkpoint_dir, tmp_path, kind, capsys):
    out = tmp_path / "out"
    FOREIGN[kind](out)
    before = _snapshot(out)
    assert cli("merge_checkpoint", [str(merge_checkpoint_dir), str(out), "--overwrite"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("merge_checkpoint.py: error: ") and str(out) in err[0], err
    assert _snapshot(out) == before


def test_merge_overwrite_replaces_a_model_folder(merge_checkpoint_dir, tmp_path):
    out = _model_folder(tmp_path / "out")
    merge_checkpoint(merge_checkpoint_dir, out, overwrite=True, log=lambda *_: None)
    # the result ships without our marker
    assert is_model_folder(out) and not (out / MARKER).exists()
    # no staging left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_staging_named_folders_of_others_are_kept(tmp_path):
    out = tmp_path / "merged"
    # no such process
    dead = 2**22 + 12345
    theirs = tmp_path / f".merged.tmp-{socket.gethostname()}-{dead}"
    _notes(theirs)
    ours = make_folder(tmp_path / f".merged.old-{socket.gethostname()}-{dead}", "merge staging")
    remove_stale_staging(out, log=lambda *_: None)
    assert theirs.is_dir() and (theirs / "notes.txt").is_file()
    assert not ours.exists()
    export_dir = tmp_path / "run"
    export_dir.mkdir()
    _notes(export_dir / ".export-tmp")
    with pytest.raises(RefusedRemoval, match="export-tmp"):
        remove_export_leftovers(export_dir, log=lambda *_: None)
    assert (export_dir / ".export-tmp" / "notes.txt").is_file()


def test_rotation_deletes_only_checkpoints(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _checkpoint(run / f"checkpoint-{step}", marked=step != 2)
    (run / "checkpoint-1" / "notes.txt").write_text("made by a run, then a file was added: no longer only a checkpoint")
    # named like one, holds a user's files
    _notes(run / "checkpoint-0")
    said = []
    # unmarked but checkpoint-shaped
    assert [p.name for p in rotate(run, 2, warn=said.append)] == ["checkpoint-2"]
    assert (
        len(said) == 2
        and "kept checkpoint-1, not a checkpoint holding nothing else (it holds notes.txt, which a checkpoint does not)"
        in said[0]
    ), said
    assert (
        "kept checkpoint-0, not a checkpoint holding nothing else (it holds data/, which a checkpoint does not)"
        in said[1]
    ), said
    assert (run / "checkpoint-0" / "notes.txt").is_file() and (run / "checkpoint-1" / "notes.txt").is_file()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-0", "checkpoint-1", "checkpoint-3", "checkpoint-4"]


@pytest.mark.parametrize("best", [1, 3, 5])
def test_the_end_of_training_cleanup_keeps_the_best_alone_and_what_is_not_only_a_checkpoint(tmp_path, best):
    """save_total_limit 1 with a best model, as training ends: the Trainer's rule (every other checkpoint goes, the
    newest included), through rotate."""
    run = tmp_path / "run"
    for step in (1, 2, 3, 4, 5):
        _checkpoint(run / f"checkpoint-{step}", marked=True)
    (run / "checkpoint-4" / "eval.txt").write_text("a user's")
    said = []
    gone = rotate(run, 1, keep=str(run / f"checkpoint-{best}"), warn=said.append, keep_newest=False)
    assert sorted(p.name for p in run.iterdir()) == sorted({f"checkpoint-{best}", "checkpoint-4"})
    assert sorted(p.name for p in gone) == sorted({f"checkpoint-{s}" for s in (1, 2, 3, 5)} - {f"checkpoint-{best}"})
    assert len(said) == 1 and "kept checkpoint-4" in said[0]


# A user's folder named like a checkpoint whose every file carries a name a checkpoint may hold: no checkpoint
# without our marker or its core (trainer_state.json and weights); README.md (peft's card) only beside an adapter.
NAMED_LIKE = [
    "README.md",
    "config.json",
    "tokenizer.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.txt",
    "model.safetensors",
    "pytorch_model.bin",
]
LOOKALIKES = [{name} for name in NAMED_LIKE] + [
    set(NAMED_LIKE),
    {"README.md", "model.safetensors", "trainer_state.json"},
    {"config.json", "tokenizer.json", "model.safetensors"},
    set(),
    {"training_args.bin"},
    # the Trainer's save_model of a model and of a peft adapter (a Hub snapshot)
    {"config.json", "model.safetensors", "tokenizer.json", "training_args.bin"},
    {"adapter_config.json", "adapter_model.safetensors", "README.md", "training_args.bin"},
]


@pytest.mark.parametrize("names", LOOKALIKES, ids=["+".join(sorted(n)) or "empty" for n in LOOKALIKES])
def test_a_folder_of_checkpoint_names_without_a_checkpoint_is_never_deleted(tmp_path, names, launched):
    run = tmp_path / "run"
    _checkpoint(run / "checkpoint-9", marked=True)
    user = run / "checkpoint-5"
    user.mkdir()
    for name in names:
        (user / name).write_text("a user's")
    assert not is_checkpoint_folder(user)
    said = []
    assert (
        rotate(run, 1, warn=said.append) == []
        and "kept checkpoint-5, not a checkpoint holding nothing else (it " in said[0]
    )
    with pytest.raises(RecipeError, match="checkpoint-5 is not a training checkpoint holding nothing else"):
        check_output_dir(str(run), resuming=False, overwrite=True)
    # and no message offers the deleting flag for it
    with pytest.raises(RecipeError) as refused:
        check_output_dir(str(run), resuming=False, overwrite=False)
    assert "overwrite_output_dir" not in str(refused.value)
    assert sorted(p.name for p in user.iterdir()) == sorted(names)


# what other writers leave, complete or cut short (no trainer_state.json, no marker)
STOCK_CHECKPOINTS = {
    "incomplete sharded": [
        "rng_state_0.pth",
        "pytorch_model_fsdp_0/.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp",
        "optimizer_0/__1_0.distcp",
    ],
    "rank-local DCP metadata": [
        "pytorch_model_fsdp_0/__0.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp",
        "trainer_state.json",
    ],
    "bin weights": [
        "pytorch_model.bin",
        "config.json",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        "training_args.bin",
    ],
    "sharded bin": [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
        "trainer_state.json",
    ],
    "peft bin + BERT vocab": ["adapter_model.bin", "adapter_config.json", "README.md", "vocab.txt", "optimizer.pt"],
    "T5 tokenizer": ["model.safetensors", "spiece.model", "scheduler.pt"],
}


@pytest.mark.parametrize("kind", sorted(STOCK_CHECKPOINTS))
def test_other_writers_checkpoints_and_incomplete_ones_are_checkpoints(tmp_path, kind, launched):
    """--overwrite_output_dir is what the refusal of an incomplete checkpoint names: it must be able to delete one, and
    rotation must not keep the stock Trainer's checkpoints forever (the disk would fill)."""
    run = tmp_path / "run"
    for name in STOCK_CHECKPOINTS[kind]:
        (run / "checkpoint-4" / name).parent.mkdir(parents=True, exist_ok=True)
        (run / "checkpoint-4" / name).write_bytes(b"x")
    assert is_checkpoint_folder(run / "checkpoint-4")
    assert check_output_dir(str(run), resuming=False, overwrite=True) == [run / "checkpoint-4"]


def test_an_unreadable_folder_is_named_and_rotation_goes_on(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        _checkpoint(run / f"checkpoint-{step}", marked=True)
    iterdir = Path.iterdir

    def denied(self):
        if self.name == "optimizer_0" and self.parent.name == "checkpoint-2" or self.name == "checkpoint-2":
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", denied)
    said = []
    assert [p.name for p in rotate(run, 1, warn=said.append)] == ["checkpoint-1"]
    assert said == [
        "save_total_limit: kept checkpoint-2, not a checkpoint holding nothing else (unreadable: Permission "
        "denied); move it away"
    ]


def test_a_readme_put_into_our_checkpoint_keeps_it(tmp_path):
    """peft writes README.md beside an adapter; in a checkpoint without one it is someone's."""
    run = tmp_path / "run"
    for step in (3, 6):
        _checkpoint(run / f"checkpoint-{step}", marked=True)
    (run / "checkpoint-3" / "README.md").write_text("a user's")
    assert not is_checkpoint_folder(run / "checkpoint-3")
    (run / "checkpoint-6" / "adapter_config.json").write_text("{}")
    (run / "checkpoint-6" / "README.md").write_text("peft's card")
    assert is_checkpoint_folder(run / "checkpoint-6")


def test_a_checkpoint_that_will_not_go_is_named_and_the_run_goes_on(tmp_path, monkeypatch):
    """The Trainer's cleanup ignores errors; ours says which folder stayed (an NFS .nfsXXXX file, a permission)."""
    import errno

    run = tmp_path / "run"
    for step in (1, 2, 3):
        _checkpoint(run / f"checkpoint-{step}", marked=True)

    def refuse(path, *args, **kwargs):
        raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    said = []
    assert rotate(run, 1, warn=said.append) == []
    assert len(said) == 2 and all("could not delete checkpoint-" in s and "delete it yourself" in s for s in said), said
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_copied_marker_proves_nothing(tmp_path):
    """The marker binds to the folder it was written into (device and inode): cp -a of a marked folder, or the
    marker file copied into another folder, does not make that folder ours."""
    ours = make_folder(tmp_path / "ours", "merge staging")
    copy = tmp_path / "copy"
    # as cp -a
    shutil.copytree(ours, copy)
    (copy / "photo.jpg").write_bytes(b"x")
    with pytest.raises(RefusedRemoval, match="refusing"):
        remove(copy, "merge staging")
    assert (copy / "photo.jpg").is_file()
    remove(ours, "merge staging")
    assert not ours.exists()


def test_setting_aside_never_deletes(tmp_path):
    run = tmp_path / "run"
    first = set_aside(_checkpoint(run / "checkpoint-5", marked=True))
    second = set_aside(_checkpoint(run / "checkpoint-5", marked=True))
    assert first.is_dir() and second.is_dir() and first != second


@pytest.fixture
def launched(monkeypatch):
    for key, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("where", ["is", "inside", "holds"])
@pytest.mark.parametrize("key", ["model_name_or_path", "config_name", "tokenizer_name"])
def test_output_dir_never_overlaps_an_input(tmp_path, where, key, launched):
    model = _model_folder(tmp_path / "models" / "base")
    out = {"is": model, "inside": model / "run", "holds": tmp_path / "models"}[where]
    before = _snapshot(tmp_path)
    with pytest.raises(RecipeError, match=f"output_dir .* {key} .*choose another --output_dir"):
        check_output_dir(str(out), resuming=False, overwrite=True, inputs={key: str(model)})
    assert _snapshot(tmp_path) == before


def test_resume_into_another_runs_output_dir_is_refused(tmp_path, launched):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    ckpt_a = _checkpoint(run_a / "checkpoint-4", marked=True)
    _checkpoint(run_b / "checkpoint-2", marked=True)
    for overwrite in (False, True):
        with pytest.raises(RecipeError, match="holds another run's checkpoints .* the resume comes from"):
            check_output_dir(str(run_b), resuming=True, overwrite=overwrite, resume=str(ckpt_a))
    # a fresh folder: fine
    check_output_dir(str(tmp_path / "c"), resuming=True, overwrite=False, resume=str(ckpt_a))
    # its own folder: fine
    check_output_dir(str(run_a), resuming=True, overwrite=False, resume=str(ckpt_a))


def test_overwrite_output_dir_refuses_a_checkpoint_holding_other_files(tmp_path, launched):
    run = tmp_path / "run"
    _checkpoint(run / "checkpoint-3", marked=False)
    (run / "checkpoint-3" / "notes.txt").write_text("mine")
    with pytest.raises(
        RecipeError,
        match="checkpoint-3 is not a training checkpoint holding nothing else .it holds notes.txt, which a "
        "checkpoint does not",
    ):
        check_output_dir(str(run), resuming=False, overwrite=True)
    assert (run / "checkpoint-3" / "notes.txt").is_file()


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_output_dir_holding_someone_elses_files_is_refused(tmp_path, kind, launched):
    """The final export writes config.json, tokenizer files and weights into output_dir: a folder holding anything a
    run does not write (a home folder, a project) is refused before anything starts."""
    out = tmp_path / "out"
    FOREIGN[kind](out)
    # a link to a model folder holds only model files: a run may write there
    if kind in ("link to a model",):
        return
    before = _snapshot(out)
    with pytest.raises(RecipeError, match="holds (files a training run does not write|another tool's model or run)"):
        check_output_dir(str(out), resuming=False, overwrite=True)
    assert _snapshot(out) == before


# Where the libraries a run goes through delete, move or replace files (calls per function), and why none of it reaches
# what this project did not make. A pinned upgrade that adds one, anywhere in these modules, fails here, to be judged
# before it can delete a user's folder.
CACHE = "their own cache or temporary files"
LIBRARY_DELETES = {
    "transformers.trainer:Trainer._finalize_training": (
        1,
        "save_total_limit is None around it (FSDPTrainer._finalize_training), which rotates itself",
    ),
    "transformers.trainer_utils:rotate_checkpoints": (
        1,
        "Trainer._save_checkpoint's; save_total_limit is None around it (FSDPTrainer)",
    ),
    "transformers.trainer_pt_utils:remove_dummy_checkpoint": (1, "DeepSpeed's save_model only"),
    "transformers.trainer_jit_checkpoint:CheckpointManager.execute_jit_checkpoint": (1, "its own sentinel file"),
    "transformers.modeling_utils:PreTrainedModel.save_pretrained": (
        1,
        "stale shards of the target folder: we save only into folders we just made",
    ),
    "transformers.distributed.mixin:DistributedMixin.save_distributed_checkpoint": (
        1,
        "push_to_hub of a distributed checkpoint only",
    ),
    "transformers.integrations.integration_utils:NeptuneCallback.__del__": (1, "its own temporary folder"),
    "accelerate.accelerator:Accelerator.save_model": (1, "not called: the Trainer saves through save_pretrained"),
    "accelerate.accelerator:Accelerator.save_state": (
        1,
        "total_limit of automatic checkpoint naming, which the Trainer does not set",
    ),
    "accelerate.utils.fsdp_utils:merge_fsdp_weights": (
        1,
        "accelerate merge-weights (the benchmark's baseline), never called by us",
    ),
    "accelerate.utils.modeling:load_checkpoint_in_model": (1, "its own offload folder"),
    "torch.distributed.checkpoint.filesystem:FileSystem.rename": (
        1,
        "DCP's .metadata.tmp -> .metadata, in a checkpoint folder we made",
    ),
    "torch.distributed.checkpoint.filesystem:FileSystem.rm_file": (1, "not called by DCP's save or load"),
    "torch.distributed.checkpoint.filesystem:_FileSystemWriter.finish": (1, "the same rename"),
    "torch.distributed.checkpoint.staging:_ReplicationStager._persist_state_dict": (2, "replicated staging, not used"),
    "datasets.arrow_dataset:Dataset._map_single": (2, CACHE),
    "datasets.arrow_dataset:Dataset._push_parquet_shards_to_hub_single": (2, "push_to_hub only"),
    "datasets.arrow_dataset:Dataset._select_with_indices_mapping": (2, CACHE),
    "datasets.arrow_dataset:Dataset.cleanup_cache_files": (1, CACHE),
    "datasets.builder:DatasetBuilder.__init__": (1, CACHE),
    "datasets.builder:DatasetBuilder.download_and_prepare.incomplete_dir": (3, CACHE),
    "huggingface_hub.file_download:_cache_commit_hash_for_specific_revision": (1, CACHE),
    "huggingface_hub.file_download:_chmod_and_move": (2, CACHE),
    "huggingface_hub.file_download:_create_symlink": (2, CACHE),
    "huggingface_hub.file_download:_download_to_tmp_and_move": (1, CACHE),
    "huggingface_hub.file_download:_hf_hub_download_to_local_dir": (1, "downloads, which no run here makes"),
    "huggingface_hub.file_download:_replace_no_matter_what": (9, CACHE),
    "huggingface_hub.serialization._torch:save_torch_state_dict": (
        1,
        "stale shards of the target folder, as save_pretrained",
    ),
}
LIBRARY_MODULES = [
    "transformers.trainer",
    "transformers.trainer_utils",
    "transformers.trainer_pt_utils",
    "transformers.trainer_callback",
    "transformers.trainer_jit_checkpoint",
    "transformers.training_args",
    "transformers.modeling_utils",
    "transformers.distributed.mixin",
    "transformers.integrations.integration_utils",
    "transformers.integrations.fsdp",
    "accelerate.accelerator",
    "accelerate.checkpointing",
    "accelerate.utils.fsdp_utils",
    "accelerate.utils.modeling",
    "accelerate.utils.other",
    "peft.peft_model",
    "peft.utils.save_and_load",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.staging",
    "torch.distributed.checkpoint.state_dict_saver",
    "datasets.builder",
    "datasets.arrow_dataset",
    "huggingface_hub.file_download",
    "huggingface_hub.serialization._torch",
]


def _deletes_by_function(source: str, module: str) -> dict[str, int]:
    """Deleting calls per enclosing function: os./shutil. ones by any alias, names imported from them, Path methods."""
    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name: a.name for a in node.names if a.name in ("os", "shutil")}
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            aliases |= {
                a.asname or a.name: f"{node.module}.{a.name}" for a in node.names if (node.module, a.name) in DELETING
            }
    found, scope = {}, []

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_Call(self, node):
            func = node.func
            if isinstance(func, ast.Attribute):
                owner = aliases.get(func.value.id, func.value.id) if isinstance(func.value, ast.Name) else None
                hit = (
                    (owner, func.attr) in DELETING
                    or func.attr in PATH_METHODS
                    or (func.attr == "replace" and len(node.args) == 1 and not node.keywords)
                )
            else:
                hit = isinstance(func, ast.Name) and "." in aliases.get(func.id, "")
            if hit:
                key = f"{module}:{'.'.join(scope)}"
                found[key] = found.get(key, 0) + 1
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def test_the_library_delete_scan_finds_every_form():
    source = """
import os, shutil as sh
from shutil import rmtree as gone
from pathlib import Path
def a(p):
    sh.rmtree(p); gone(p); os.replace(p, p); Path(p).unlink(); Path(p).replace(p); "x".replace("a", "b")
class B:
    def c(self, p):
        os.rename(p, p)
"""
    assert _deletes_by_function(source, "m") == {"m:a": 5, "m:B.c": 1}


def test_every_delete_in_the_libraries_a_run_goes_through_is_known_and_cannot_reach_a_users_files():
    import importlib
    import inspect

    found = {}
    for module in LIBRARY_MODULES:
        found |= _deletes_by_function(inspect.getsource(importlib.import_module(module)), module)
    known = {key: count for key, (count, _) in LIBRARY_DELETES.items()}
    assert found == known, (
        f"new or changed: {sorted(set(found.items()) - set(known.items()))}; gone: "
        f"{sorted(set(known.items()) - set(found.items()))}"
    )
    from fsdp_recipes.train.trainer import FSDPTrainer

    # the two Trainer deletes, taken over
    assert {"_finalize_training", "_save_checkpoint"} <= set(vars(FSDPTrainer))


def _stock_trainer_run(out: Path) -> None:
    """What transformers' run_clm.py leaves in its output_dir: train, save_model, save_state, the metrics files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tiny = REPO / "assets" / "tiny-llama"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    ids = torch.randint(0, model.config.vocab_size, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        str(out),
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(tiny))
    metrics = trainer.train().metrics
    trainer.save_model()
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()


def test_a_stock_trainers_finished_run_is_not_taken_for_ours(tmp_path):
    """A stock Trainer's finished output_dir is another tool's, refused before anything starts, for a new run and a
    resume: its trainer_state.json, train_results.json and all_results.json have our names, and without our
    run_args.json a run would overwrite or merge into them and put model/ beside its model."""
    out = tmp_path / "stock"
    _stock_trainer_run(out)
    # the case is real
    assert (out / "trainer_state.json").is_file() and (out / "all_results.json").is_file()
    before = _snapshot(out)
    for resuming in (False, True):
        with pytest.raises(
            RecipeError,
            match=r"holds another tool's model or run \(.*no run_args.json, which every run of this repository "
            r"writes first\)",
        ):
            check_output_dir(str(out), resuming=resuming, overwrite=True)
    assert _snapshot(out) == before


SHARED_NAMES = [
    "trainer_state.json",
    "all_results.json",
    "train_results.json",
    "eval_results.json",
    "training_args.bin",
    "config.json",
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "tokenizer.json",
    "generation_config.json",
    "fsdp_report.json",
    "loss.png",
    "adapter_config.json",
    "adapter_model.safetensors",
]


@pytest.mark.parametrize("name", SHARED_NAMES)
def test_a_record_of_a_finished_run_is_ours_only_beside_run_args(tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("x")
    # tensorboard's folder, which both write: no sign either way
    (out / "runs").mkdir()
    with pytest.raises(RecipeError, match=f"holds another tool's model or run \\({re.escape(name)}"):
        check_output_dir(str(out), resuming=False, overwrite=False)
    (out / "run_args.json").write_text("{}")
    assert check_output_dir(str(out), resuming=False, overwrite=False) == []


@pytest.mark.parametrize("kind", ["old", "tmp"])
@pytest.mark.parametrize("whose", ["dead here", "alive here", "another host"])
@pytest.mark.parametrize("out_exists", [False, True])
# a name that globs as a pattern must not hide its neighbours
@pytest.mark.parametrize("name", ["out", "run[1]"])
def test_what_a_merge_moved_aside_is_restored_or_named_never_passed_over(tmp_path, kind, whose, out_exists, name):
    """A folder a merge into ``out`` moved aside (.old-) or finished (.tmp-): of a killed merge here, the earlier
    output goes back when ``out`` is missing, anything else is kept and named; of a merge on another host or of a
    process alive here (a merge running, or the number reused), nobody here can tell whether it still runs: it is
    left where it is, and named (it was passed over without a word: an earlier model hidden on a shared filesystem)."""
    import subprocess

    from fsdp_recipes.ckpt.merge_output import restore_interrupted

    dead = subprocess.Popen(["true"])
    dead.wait()
    host, pid = {
        "dead here": (socket.gethostname(), dead.pid),
        "alive here": (socket.gethostname(), os.getppid()),
        "another host": ("node-17.cluster", dead.pid),
    }[whose]
    aside = _model_folder(tmp_path / f".{name}.{kind}-{host}-{pid}")
    out = tmp_path / name
    if out_exists:
        _model_folder(out)
    before = _snapshot(aside)
    said = []
    restore_interrupted(out, log=said.append)
    [line] = said
    if whose == "dead here" and kind == "old" and not out_exists:
        assert line.startswith(f"restored {out}") and not aside.exists() and _snapshot(out) == before
        return
    assert aside.exists() and _snapshot(aside) == before and str(aside) in line and f"process {pid}" in line, line
    if whose != "dead here":
        assert line.startswith(f"left {aside} alone") and "may still be running" in line, line
        assert (
            f"process {pid} on {host})" in line if whose == "another host" else f"process {pid}, alive here)" in line
        ), line


@pytest.mark.parametrize("killed_at", [1, 2])
def test_a_merge_killed_between_its_renames_loses_nothing(merge_checkpoint_dir, tmp_path, monkeypatch, killed_at):
    """--overwrite moves the earlier output aside, then the result in: a merge killed between the two leaves no output
    and the earlier model hidden as .out.old-*. The next merge puts it back before deciding anything
    (here it then refuses to replace it without --overwrite), and names the finished result the killed one left."""
    import fsdp_recipes.ckpt.merge as merge_module
    import fsdp_recipes.ckpt.merge_output as merge_output

    out = _model_folder(tmp_path / "out")
    (out / "config.json").write_text('{"mine": true}')
    before = _snapshot(out)
    real_move, calls = merge_module.move, []

    def killed_move(src, dst):
        calls.append(dst)
        if len(calls) == killed_at:
            # the except clause then removes only our marked staging: as a kill leaves it
            raise KeyboardInterrupt
        return real_move(src, dst)

    monkeypatch.setattr(merge_module, "move", killed_move)
    with pytest.raises(KeyboardInterrupt):
        merge_checkpoint(merge_checkpoint_dir, out, overwrite=True, log=lambda *_: None)
    monkeypatch.setattr(merge_module, "move", real_move)
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))
    # the state the probe found: no output, the earlier one hidden
    if killed_at == 2:
        assert not out.exists() and any(".old-" in name for name in hidden), hidden
    # the next merge is another process
    monkeypatch.setattr(merge_module.os, "getpid", lambda: 2**22 + 777)
    # the killed one is gone
    monkeypatch.setattr(merge_output, "process_alive", lambda pid: pid == 2**22 + 777)
    said = []
    with pytest.raises(CheckpointError, match="already exists: choose another folder or pass --overwrite"):
        merge_checkpoint(merge_checkpoint_dir, out, log=said.append)
    assert _snapshot(out) == before and (out / "config.json").read_text() == '{"mine": true}'
    # the finished result the interrupted merge had not moved in was removed by its own cleanup
    if killed_at == 2:
        assert any(line.startswith(f"restored {out}") for line in said), said
        assert not any("finished result" in line for line in said) and not [
            p for p in tmp_path.iterdir() if ".tmp-" in p.name
        ], said


@pytest.mark.parametrize("pid", [0, -1, -os.getpgrp()])
def test_no_process_number_is_alive(pid):
    """kill(0, 0) asks about this process group, kill(-n, 0) about group n: a staging or lock name with such a number
    is no live process's, and is not kept for good."""
    from fsdp_recipes.removal import process_alive

    assert not process_alive(pid) and process_alive(os.getpid())


def _bind(source: Path, target: Path) -> bool:
    """A real bind mount (root with CAP_SYS_ADMIN, as on the dev and CI machines); False where it is not allowed."""
    target.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode == 0


# Where a mount point can sit in a folder the tools would remove, and each function that removes a folder (a folder
# that is itself the mount has another inode than the one its marker names: only a shape could take it)
MOUNT_CASES = [
    ("remove, by shape", ""),
    ("remove, by shape", "pytorch_model_fsdp_0"),
    ("remove, by shape", "a/b c"),
    ("remove, ours", "pytorch_model_fsdp_0"),
    ("remove, ours", "a/b c"),
    ("remove_inside", "pytorch_model_fsdp_0"),
    ("remove_inside", "a/b c"),
]


@pytest.mark.parametrize("how, inside", MOUNT_CASES)
def test_a_mount_point_inside_is_never_removed_through(tmp_path, how, inside):
    """A bind mount of another folder looks like any folder (same device, no link), and rmtree would empty another
    run's checkpoint mounted into this one (--overwrite_output_dir, rotation). Generated over where the mount
    sits and each function that removes a folder: refused in one line, the mounted folder whole."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "weights.distcp").write_bytes(b"theirs")
    folder = make_folder(tmp_path / "run" / "checkpoint-2", "test")
    target = folder / inside if inside else folder
    if not _bind(precious, target):
        pytest.skip("bind mounts are not allowed here")
    try:
        with pytest.raises(RefusedRemoval, match=r"is or holds a mount point \(.*\): refusing to remove it"):
            if how == "remove, by shape":
                remove(folder, "test", shape=lambda p: True)
            elif how == "remove, ours":
                remove(folder, "test")
            else:
                remove_inside(folder, inside.split("/")[0], "test")
        assert (precious / "weights.distcp").read_bytes() == b"theirs"
    finally:
        subprocess.run(["umount", str(target)], capture_output=True)


class Stopped(Exception):
    pass


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment", ["after the mkdir", "after the marker"])
def test_a_stop_while_a_folder_is_made_leaves_it_marked_for_removal(tmp_path, monkeypatch, signum, moment):
    """A stop arriving between the folder's mkdir and its marker is held until the marker is written: the folder it
    leaves is ours, so remove (and a later run's clean-up) takes it; never an unmarked folder nothing may remove."""
    import signal

    from fsdp_recipes import removal

    def stop(*_):
        raise Stopped

    previous = signal.signal(getattr(signal, signum), stop)
    real_mkdir, real_marker = Path.mkdir, removal._write_marker

    def mkdir(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if moment == "after the mkdir" and self == tmp_path / "staging":
            os.kill(os.getpid(), getattr(signal, signum))

    def marker(path, purpose):
        real_marker(path, purpose)
        if moment == "after the marker":
            os.kill(os.getpid(), getattr(signal, signum))

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(removal, "_write_marker", marker)
    try:
        with pytest.raises(Stopped):
            make_folder(tmp_path / "staging", "test staging")
    finally:
        signal.signal(getattr(signal, signum), previous)
    assert (tmp_path / "staging" / MARKER).is_file()
    remove(tmp_path / "staging", "test staging")
    assert not (tmp_path / "staging").exists()
