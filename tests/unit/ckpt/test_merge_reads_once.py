"""A merge reads each of a checkpoint's description files once: config.json, the manifest, and every file the manifest
records (hashed), whatever way the checkpoint is described (its manifest, transformers, a run folder's config) and
whoever merges it (tools/merge_checkpoint.py, the final export). One read builds the checkpoint's description
(fsdp_recipes.ckpt.description.read_files) and every later step takes it: a file read twice may be two different
files, and each read of a large tokenizer costs time.

The checkpoints are written in this process as the stock Trainer saves a model (one safetensors file), with the
manifest a training run writes beside it: the weights' reader reads no JSON of its own.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO

from fsdp_recipes import bounded
from fsdp_recipes.ckpt import description
from fsdp_recipes.ckpt.layout import MANIFEST
from fsdp_recipes.ckpt.merge import merge_checkpoint

TINY = REPO / "assets" / "tiny-llama"


@pytest.fixture(scope="module")
def described(tmp_path_factory) -> Path:
    """checkpoint-4 of a run: the tiny Llama's weights, config, generation config, tokenizer and chat template, and
    the sealed manifest that records them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY)
    ckpt = tmp_path_factory.mktemp("run") / "checkpoint-4"
    AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(TINY / name, ckpt / name)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    description.write_manifest(ckpt, config, files)
    description.seal_manifest(ckpt)
    return ckpt


def _without_manifest(ckpt: Path):
    (ckpt / MANIFEST).unlink()
    return lambda out: merge_checkpoint(ckpt, out, log=lambda *_: None)


def _config_in_the_run_folder(ckpt: Path):
    (ckpt / MANIFEST).unlink()
    (ckpt / "config.json").rename(ckpt.parent / "config.json")
    return lambda out: merge_checkpoint(ckpt, out, log=lambda *_: None)


def _final_export(ckpt: Path):
    from fsdp_recipes.train.model_folder import export_checkpoint

    # the run's own model source stands in only for a missing config.json
    def export(out: Path) -> None:
        export_checkpoint(ckpt, out.parent / "export", base_model=str(TINY), log=lambda *_: None)
        (out.parent / "export" / "model").rename(out)

    return export


# how the checkpoint is described -> the merge, given the checkpoint (changed for it) and the output
WAYS = {
    "by its manifest": lambda ckpt: lambda out: merge_checkpoint(ckpt, out, log=lambda *_: None),
    "by its manifest, as the final export": _final_export,
    "by transformers, for a cast": lambda ckpt: (
        lambda out: merge_checkpoint(ckpt, out, dtype="bfloat16", log=lambda *_: None)
    ),
    "by transformers, another tool's checkpoint": _without_manifest,
    "by the run folder's config": _config_in_the_run_folder,
}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_merge_reads_each_description_file_once(described, tmp_path, monkeypatch, way):
    ckpt = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(described, ckpt)
    merge = WAYS[way](ckpt)
    reads, hashes = Counter(), Counter()
    read_bytes, sha256 = bounded.read_bytes, description._sha256

    def counted_read(path, *args):
        reads[Path(path).relative_to(tmp_path).as_posix()] += 1
        return read_bytes(path, *args)

    def counted_hash(path):
        hashes[Path(path).relative_to(tmp_path).as_posix()] += 1
        return sha256(path)

    monkeypatch.setattr(bounded, "read_bytes", counted_read)
    monkeypatch.setattr(description, "_sha256", counted_hash)
    merge(tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert reads, "the merge read nothing through fsdp_recipes.bounded: the count is not counting"
    assert {p: n for p, n in reads.items() if n > 1} == {}, reads
    assert {p: n for p, n in hashes.items() if n > 1} == {}, hashes
