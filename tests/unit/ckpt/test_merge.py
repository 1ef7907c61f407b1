"""tools/merge_checkpoint.py against real checkpoints written by train_fsdp.py, and every bad input."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from accelerate.utils import merge_fsdp_weights
from conftest import REPO, _snapshot, cli, run
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fsdp_recipes.ckpt.inspection import inspect_checkpoint
from fsdp_recipes.ckpt.layout import MANIFEST
from fsdp_recipes.ckpt.merge import merge_checkpoint
from fsdp_recipes.direct_writes import CHUNK
from fsdp_recipes.errors import CheckpointError

TOOL = str(REPO / "tools" / "merge_checkpoint.py")
SHARDED = [
    "accelerate_configs/zero3.yaml",
    "accelerate_configs/zero2.yaml",
    "accelerate_configs/fsdp1/zero3.yaml",
    "accelerate_configs/fsdp1/zero2.yaml",
    # the last: 4 ranks, 2 replicas
    "accelerate_configs/hybrid_shard.yaml",
]
FULL = ("--fsdp_state_dict_type", "FULL_STATE_DICT")


def cli_main(argv: list[str]) -> int:
    """The CLI's main(), in this process: bad-input cases need no fresh interpreter each."""
    spec = importlib.util.spec_from_file_location("merge_checkpoint_cli", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def reference_weights(dcp_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """accelerate merge-weights: an independent implementation that loads the whole state dict."""
    merge_fsdp_weights(str(dcp_dir), str(tmp), safe_serialization=True)
    return load_file(tmp / "model.safetensors")


def logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(
        ["Ada sees the red cat near the barn.", "The owl walks slowly"], return_tensors="pt", padding=True
    )
    with torch.no_grad():
        return model(**batch).logits


def assert_same_model(
    folder: Path, reference: dict[str, torch.Tensor], tied: bool = False, architecture: str = "LlamaForCausalLM"
):
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [architecture]
    assert (folder / "generation_config.json").is_file()
    loaded = model.state_dict()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    # from_pretrained's mode: no dropout
    expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).eval()
    expected.load_state_dict(reference, strict=not tied)
    assert torch.equal(logits(model, tokenizer), logits(expected, tokenizer))


@pytest.mark.parametrize("config", SHARDED)
def test_merged_run_equals_accelerate_merge_weights(trained, config, tmp_path):
    run_dir = trained(config).output_dir
    out = tmp_path / "merged"
    result = merge_checkpoint(run_dir, out, verify=True, log=lambda *_: None)
    assert result.notes == [f"using checkpoint-12, the newest complete checkpoint in {run_dir}"]
    reference = reference_weights(run_dir / "checkpoint-12" / "pytorch_model_fsdp_0", tmp_path / "ref")
    written = load_file(out / "model.safetensors")
    assert set(written) == set(reference)
    for name in reference:
        assert torch.equal(written[name], reference[name]), name
        assert not any(p in name for p in ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"))
    assert_same_model(out, reference)
    assert not list(tmp_path.glob(".merged.*"))


def test_middle_checkpoint_and_its_model_folder_merge_alone(trained, tmp_path):
    """Each checkpoint-N carries its own config and tokenizer, so it merges without the run folder."""
    ckpt = trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-6"
    alone = tmp_path / "checkpoint-6"
    shutil.copytree(ckpt, alone)
    merge_checkpoint(alone, tmp_path / "a", log=lambda *_: None)
    merge_checkpoint(alone / "pytorch_model_fsdp_0", tmp_path / "b", log=lambda *_: None)
    reference = reference_weights(alone / "pytorch_model_fsdp_0", tmp_path / "ref")
    assert_same_model(tmp_path / "a", reference)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()


def without_manifest(ckpt: Path, tmp: Path) -> Path:
    """A copy of the checkpoint as another tool would leave it: no model_description.json."""
    copy = tmp / "no-manifest" / ckpt.name
    shutil.copytree(ckpt, copy, ignore=shutil.ignore_patterns(MANIFEST))
    return copy


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


MERGE_AND_LIST_MODULES = """
import sys
from fsdp_recipes.ckpt.merge import merge_checkpoint
merge_checkpoint(sys.argv[1], sys.argv[2], log=lambda *a: None)
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "accelerate"}))
"""


def test_checkpoint_manifest_gives_the_same_folder_as_transformers(trained, tmp_path):
    """Our checkpoints carry a manifest: the copy starts from it (config and tokenizer copied as they are) while
    transformers checks config.json against the weights beside it; the folder is the same, byte for byte, as the
    one the path without a manifest writes."""
    ckpt = trained("accelerate_configs/fsdp1/zero2.yaml").output_dir / "checkpoint-12"
    assert (ckpt / MANIFEST).is_file()
    proc = run(["python", "-c", MERGE_AND_LIST_MODULES, str(ckpt), str(tmp_path / "fast")])
    assert proc.returncode == 0, proc.stderr
    # the manifest is a claim: config.json is still checked against the shards
    assert "transformers" in proc.stdout
    # the path without a manifest in this process: only the first merge's module list needs a fresh interpreter
    merge_checkpoint(without_manifest(ckpt, tmp_path), tmp_path / "slow", log=lambda *_: None)
    assert folder_bytes(tmp_path / "fast") == folder_bytes(tmp_path / "slow")
    assert_same_model(tmp_path / "fast", reference_weights(ckpt / "pytorch_model_fsdp_0", tmp_path / "ref"))


def test_tied_embeddings_written_once_as_save_pretrained_does(gpt2_run, tmp_path):
    """GPT-2's head is its input embedding: written once, under the embedding's name, and tied again on loading."""
    run_dir = gpt2_run.output_dir
    out = tmp_path / "merged"
    merge_checkpoint(run_dir, out, verify=True, log=lambda *_: None)
    # the manifest records the tie; through transformers (no manifest) the folder comes out the same, byte for byte
    merge_checkpoint(
        without_manifest(run_dir / "checkpoint-12", tmp_path), tmp_path / "via-transformers", log=lambda *_: None
    )
    assert folder_bytes(tmp_path / "via-transformers") == folder_bytes(out)
    written = load_file(out / "model.safetensors")
    assert "transformer.wte.weight" in written and "lm_head.weight" not in written
    reference = reference_weights(run_dir / "checkpoint-12" / "pytorch_model_fsdp_0", tmp_path / "ref")
    assert set(reference) - set(written) <= {"lm_head.weight"}
    assert_same_model(
        out, {k: v for k, v in reference.items() if k != "lm_head.weight"}, tied=True, architecture="GPT2LMHeadModel"
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("config", ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"])
def test_full_state_dict_checkpoints(trained, config, tmp_path):
    run_dir = trained(config, launch_args=FULL).output_dir
    ckpt = run_dir / "checkpoint-12"
    assert (ckpt / "pytorch_model_fsdp.bin").is_file() and not (ckpt / "pytorch_model_fsdp_0").exists()
    from_safetensors = tmp_path / "a"
    merge_checkpoint(ckpt, from_safetensors, verify=True, log=lambda *_: None)
    bin_only = tmp_path / "checkpoint-12"
    shutil.copytree(ckpt, bin_only, ignore=shutil.ignore_patterns("model.safetensors"))
    merge_checkpoint(bin_only, tmp_path / "b", verify=True, log=lambda *_: None)
    reference = torch.load(ckpt / "pytorch_model_fsdp.bin", weights_only=True)
    for folder in (from_safetensors, tmp_path / "b"):
        assert_same_model(folder, reference)
    # the run's own final folder (written by train_fsdp.py) holds the same weights
    final = load_file(run_dir / "model" / "model.safetensors")
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    # safetensors are copied by the kernel too (transformers checks the manifest beside the copy); a cut-off file
    # is named
    proc = run(["python", "-c", MERGE_AND_LIST_MODULES, str(ckpt), str(tmp_path / "c")])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (from_safetensors / "model.safetensors").read_bytes()
    cut = tmp_path / "cut" / "checkpoint-12"
    shutil.copytree(ckpt, cut, ignore=shutil.ignore_patterns("pytorch_model_fsdp.bin"))
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors is truncated \(\d+ of \d+ bytes\): copy the checkpoint again"
    ):
        merge_checkpoint(cut, tmp_path / "d", log=lambda *_: None)


def test_dtype_sharding_verify_and_inspect_through_the_cli(trained, tmp_path, capsys):
    """The tool's main(argv), in this process: --dtype, --max-shard-size, --verify, --inspect and --help."""
    run_dir = trained("accelerate_configs/fsdp1/zero3.yaml").output_dir
    out = tmp_path / "bf16"
    argv = [str(run_dir / "checkpoint-12"), str(out), "--dtype", "bfloat16", "--max-shard-size", "200KB", "--verify"]
    assert cli("merge_checkpoint", argv) == 0, capsys.readouterr().err
    assert "verified: 39 tensors equal the checkpoint" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    # header + one tensor may exceed
    assert len(shards) >= 3 and all((out / s).stat().st_size <= 200_000 + 64_000 for s in shards)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    reference = reference_weights(run_dir / "checkpoint-12" / "pytorch_model_fsdp_0", tmp_path / "ref")
    assert all(torch.equal(model.state_dict()[k], v.to(torch.bfloat16)) for k, v in reference.items())

    assert cli("merge_checkpoint", [str(run_dir), "--inspect"]) == 0, capsys.readouterr().err
    info = json.loads(capsys.readouterr().out)
    assert (info["format"], info["ranks"], info["step"], info["tensors"], info["parameters"]) == (
        "sharded (DCP)",
        2,
        12,
        39,
        242496,
    )
    assert info["optimizer_state"] is True and not (tmp_path / "inspect").exists()
    assert info["manifest"] == str(run_dir / "checkpoint-12" / "model_description.json")
    assert cli("merge_checkpoint", ["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "INPUT" in help_text.upper() and "--max-shard-size" in help_text and "memory" in help_text


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def checkpoint(trained, tmp_path) -> Path:
    """A private copy of a real 2-rank FSDP2 checkpoint, for breaking."""
    copy = tmp_path / "run" / "checkpoint-12"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", copy)
    return copy


def break_checkpoint(ckpt: Path, how: str) -> tuple[Path, str]:
    """Damage the checkpoint; return the input path to give and the error text expected."""
    model = ckpt / "pytorch_model_fsdp_0"
    if how == "nonexistent":
        return ckpt.parent / "nope", "does not exist"
    if how == "not a checkpoint":
        return ckpt.parent.parent, f"is not a checkpoint; did you mean {ckpt.parent}?"
    if how == "missing .metadata":
        (model / ".metadata").unlink()
        return ckpt, "missing"
    if how == "missing .distcp":
        (model / "__1_0.distcp").unlink()
        return ckpt, "missing"
    if how == "truncated .distcp":
        data = (model / "__0_0.distcp").read_bytes()
        (model / "__0_0.distcp").write_bytes(data[: len(data) // 2])
        return ckpt, "truncated"
    if how == "optimizer folder":
        return ckpt / "optimizer_0", "holds optimizer state, not model weights"
    # in another tool's checkpoint (ours records its files: "edited config" below)
    if how == "broken config":
        (ckpt / MANIFEST).unlink()
        (ckpt / "config.json").write_text("{ not json")
        return ckpt, "config.json is not a model config"
    if how == "edited config":
        (ckpt / "config.json").write_text("{ not json")
        return ckpt, "config.json is not as the run wrote it (checkpoint-12/model_description.json records the hash"
    if how == "no config of ours":
        (ckpt / "config.json").unlink()
        return ckpt, "config.json is missing (checkpoint-12/model_description.json records the hash"
    if how == "no config":
        (ckpt / MANIFEST).unlink(missing_ok=True)
        for f in ckpt.parent.rglob("*"):
            if f.is_file() and (
                f.name.startswith("tokenizer") or f.name.endswith("config.json") or f.suffix == ".jinja"
            ):
                f.unlink()
        return ckpt, "no config.json"
    raise AssertionError(how)


CASES = [
    "nonexistent",
    "not a checkpoint",
    "missing .metadata",
    "missing .distcp",
    "truncated .distcp",
    "optimizer folder",
    "no config",
    "broken config",
    "edited config",
    "no config of ours",
]


@pytest.mark.parametrize("how", CASES)
def test_bad_input_is_one_clear_line_and_leaves_nothing(checkpoint, how, tmp_path, capsys):
    source, expected = break_checkpoint(checkpoint, how)
    out = tmp_path / "out"
    assert cli_main([str(source), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("merge_checkpoint.py: error: ") and "\n" not in err, err
    assert expected in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_output_inside_input_and_existing_output(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="is inside the input"):
        merge_checkpoint(checkpoint, checkpoint / "merged", log=lambda *_: None)
    with pytest.raises(CheckpointError, match="is inside the input"):
        merge_checkpoint(checkpoint.parent, checkpoint.parent / "merged", log=lambda *_: None)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists: choose another folder or pass --overwrite"):
        merge_checkpoint(checkpoint, existing, log=lambda *_: None)
    assert (existing / "keep.txt").read_text() == "mine"
    # --overwrite replaces a model folder only: a user's file in it is never deleted
    with pytest.raises(CheckpointError, match=r"holds more than a model folder \(keep.txt\)"):
        merge_checkpoint(checkpoint, existing, overwrite=True, log=lambda *_: None)
    assert (existing / "keep.txt").read_text() == "mine"
    (existing / "keep.txt").unlink()
    # an earlier model folder: replaced
    (existing / "config.json").write_text("{}")
    merge_checkpoint(checkpoint, existing, overwrite=True, log=lambda *_: None)
    assert (existing / "model.safetensors").is_file() and json.loads((existing / "config.json").read_text())[
        "model_type"
    ]


# What a user can put into the output folder while a merge with --overwrite runs (it was a model folder at the start)
CHANGED_WHILE_MERGING = {
    "a notes.txt": lambda out: (out / "notes.txt").write_text("mine"),
    "a subfolder": lambda out: ((out / "eval").mkdir(), (out / "eval" / "scores.json").write_text("{}")),
    "a trainer_state.json": lambda out: (out / "trainer_state.json").write_text("{}"),
}


@pytest.mark.parametrize("change", sorted(CHANGED_WHILE_MERGING))
def test_an_output_changed_while_the_merge_runs_is_kept_in_sight(checkpoint, tmp_path, monkeypatch, change):
    """--overwrite watches the output to the end, not only at the start: a file put into it while the merge runs is
    kept whole with the earlier output as NAME.kept-2, said, and the merge ends (not an exit 1 after its result moved
    into place, the user's folder under a hidden .NAME.old-HOST-PID that later merges skip)."""
    from fsdp_recipes.ckpt import merge as merge_module

    out = tmp_path / "existing"
    out.mkdir()
    # an earlier model folder: --overwrite may replace it
    (out / "config.json").write_text("{}")
    real_sync, changed = merge_module.sync_entries, []

    # the first call is just before the output is moved aside
    def sync_after_the_user_wrote(folder):
        if not changed:
            CHANGED_WHILE_MERGING[change](out)
            # the user's folder as it is now
            changed.append(_snapshot(out))
        real_sync(folder)

    monkeypatch.setattr(merge_module, "sync_entries", sync_after_the_user_wrote)
    lines = []
    merge_checkpoint(checkpoint, out, overwrite=True, log=lines.append)
    assert changed and (out / "model.safetensors").is_file() and _snapshot(tmp_path / "existing.kept-2") == changed[0]
    assert [line for line in lines if "existing.kept-2" in line and "changed while the merge ran" in line]
    # nothing hidden left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "existing.kept-2", "run"]


def test_an_output_that_gets_a_mount_point_while_the_merge_runs_is_kept_and_said_so(checkpoint, tmp_path, monkeypatch):
    """The final removal refuses a folder holding a mount point (fsdp_recipes.removal): kept whole, and the warning
    says it is the mount point (it said "changed while the merge ran")."""
    import subprocess

    from fsdp_recipes.ckpt import merge as merge_module

    out, precious = tmp_path / "existing", tmp_path / "precious"
    out.mkdir()
    precious.mkdir()
    (precious / "weights.bin").write_bytes(b"theirs")
    (out / "config.json").write_text("{}")
    real_sync, mounted = merge_module.sync_entries, []

    def sync_after_a_mount(folder):
        if not mounted:
            (out / "data").mkdir()
            mounted.append(
                subprocess.run(["mount", "--bind", str(precious), str(out / "data")], capture_output=True).returncode
                == 0
            )
        real_sync(folder)

    monkeypatch.setattr(merge_module, "sync_entries", sync_after_a_mount)
    lines = []
    try:
        merge_checkpoint(checkpoint, out, overwrite=True, log=lines.append)
        if not mounted[0]:
            pytest.skip("bind mounts are not allowed here")
        assert [line for line in lines if "existing.kept-2" in line and "a mount point among them" in line], lines
        assert (tmp_path / "existing.kept-2" / "data" / "weights.bin").read_bytes() == b"theirs"
    finally:
        for where in (tmp_path / "existing.kept-2" / "data", out / "data"):
            subprocess.run(["umount", str(where)], capture_output=True)
    assert (precious / "weights.bin").read_bytes() == b"theirs"


def test_full_disk_is_refused_before_writing(checkpoint, tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        CheckpointError,
        match=r"not enough free disk space in .*: the merged weights need 1.0 MB and a 8.5 MB margin, 0.0 MB is free",
    ):
        merge_checkpoint(checkpoint, tmp_path / "out", log=lambda *_: None)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def test_base_model_supplies_config_and_tokenizer(checkpoint, tmp_path):
    break_checkpoint(checkpoint, "no config")
    merge_checkpoint(
        checkpoint, tmp_path / "out", base_model=str(REPO / "assets" / "tiny-llama"), verify=True, log=lambda *_: None
    )
    AutoTokenizer.from_pretrained(tmp_path / "out")
    with pytest.raises(CheckpointError, match="shape"):
        wrong = tmp_path / "wrong"
        shutil.copytree(REPO / "assets" / "tiny-llama", wrong)
        cfg = json.loads((wrong / "config.json").read_text())
        (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
        merge_checkpoint(checkpoint, tmp_path / "out2", base_model=str(wrong), log=lambda *_: None)


def test_edited_config_or_manifest_is_still_checked(checkpoint, tmp_path):
    """An edited config.json no longer matches the manifest's hash, so transformers checks it against the weights;
    a manifest that disagrees with the weights is refused by the same check."""
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    # the manifest records it
    with pytest.raises(CheckpointError, match="config.json is not as the run wrote it"):
        merge_checkpoint(checkpoint, tmp_path / "a", log=lambda *_: None)
    recorded = (checkpoint / MANIFEST).read_bytes()
    # the way past it that message names: transformers then checks it
    (checkpoint / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="has shape .* in the checkpoint but .* in the config"):
        merge_checkpoint(checkpoint, tmp_path / "a", log=lambda *_: None)
    (checkpoint / MANIFEST).write_bytes(recorded)
    (checkpoint / "config.json").write_text(json.dumps(config))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["config.json"] = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()
    manifest["weights"]["model.norm.weight"] = [7]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \(\d+,\) in the checkpoint but \(7,\)"):
        merge_checkpoint(checkpoint, tmp_path / "b", log=lambda *_: None)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".a", ".b", "a", "b"))]


def test_inspect_writes_nothing(checkpoint):
    before = sorted(p for p in checkpoint.parent.rglob("*"))
    info = inspect_checkpoint(checkpoint.parent)
    assert info["step"] == 12 and info["ranks"] == 2
    assert sorted(p for p in checkpoint.parent.rglob("*")) == before


MEASURE = """
import resource, sys, torch
from fsdp_recipes.ckpt.merge import merge_checkpoint
small, big, out, mode = sys.argv[1:]
kw = dict(memory_budget="32MB", dtype=torch.bfloat16 if mode == "cast" else None, log=lambda *a: None)
merge_checkpoint(small, out + "-small", **kw)  # same code paths and largest tensor: the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
merge_checkpoint(big, out + "-big", **kw)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, Path]:
    """(one layer, 330 MB): 2-rank FSDP2 checkpoints of a Llama shape, written by one pair of processes."""
    from bench.synthetic import make_checkpoints

    folder = tmp_path_factory.mktemp("synthetic")
    small, big = make_checkpoints({folder / "small": 1, folder / "big": 330_000_000}, ranks=2, hidden=512, vocab=8000)
    return small, big


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_model_size(synthetic, tmp_path):
    """A 2-rank checkpoint 10x the 32 MB read budget: peak RSS grows by far less than the checkpoint (at most the
    budget and the writer's two buffers), both on the raw-copy path and on the read-cast-write path (--dtype)."""
    small, big = synthetic
    big_bytes = sum(f.stat().st_size for f in (big / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert big_bytes > 300e6
    # one interpreter each: peak RSS is a high-water mark, one path's would hide the other's
    for mode in ("raw", "cast"):
        proc = run(["python", "-c", MEASURE, str(small), str(big), str(tmp_path / mode), mode])
        assert proc.returncode == 0, proc.stderr
        base_kb, peak_kb = map(int, proc.stdout.split())
        # the writer's two buffers are fixed, whatever the size (a small checkpoint may touch one, a large one both)
        assert (peak_kb - base_kb) * 1024 < 2 * CHUNK + 32e6 < big_bytes / 3, (mode, base_kb, peak_kb)
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "cast-big" / "model.safetensors").values())


# ------------------------------------------------------------------------------------------ where the output goes


def test_output_never_destroys_or_mixes_with_the_input(checkpoint, tmp_path):
    """Compared as real paths: the output may not be the input, inside it or hold it, however it is spelled
    (`..`, symlinks), --overwrite included; --overwrite never replaces a folder holding training checkpoints."""
    run_dir = checkpoint.parent
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    link = tmp_path / "link"
    link.symlink_to(checkpoint)
    cases = {
        # merging a checkpoint over its own run folder
        str(run_dir): "holds the input",
        str(run_dir / ".." / run_dir.name / checkpoint.name): "is the input",
        str(link): "is the input",
        str(link / "merged"): "is inside the input",
    }
    for output, expected in cases.items():
        with pytest.raises(CheckpointError, match=expected):
            merge_checkpoint(checkpoint, output, overwrite=True, log=lambda *_: None)
    other_run = tmp_path / "other-run"
    shutil.copytree(checkpoint, other_run / "checkpoint-3")
    with pytest.raises(
        CheckpointError,
        match=r"holds training checkpoints \(checkpoint-3, ...\): --overwrite only replaces a model folder",
    ):
        merge_checkpoint(checkpoint, other_run, overwrite=True, log=lambda *_: None)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert (other_run / "checkpoint-3" / "trainer_state.json").is_file()
    # a symlink to a model folder is replaced where it points, and stays a link
    target = tmp_path / "models" / "m"
    merge_checkpoint(checkpoint, target, log=lambda *_: None)
    (tmp_path / "m-link").symlink_to(target)
    merge_checkpoint(checkpoint, tmp_path / "m-link", overwrite=True, log=lambda *_: None)
    assert (tmp_path / "m-link").is_symlink() and (target / "model.safetensors").is_file()


def test_stale_staging_of_a_killed_merge_is_removed(checkpoint, tmp_path):
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".out.tmp-{host}-{dead.pid}"
    # a process that is alive: its merge may be running
    live = tmp_path / f".out.tmp-{host}-{os.getppid()}"
    not_ours = tmp_path / f".out.tmp-otherhost-{dead.pid}"
    # named like ours, no marker, not a model folder: someone else's (an unmarked model folder there is the earlier
    # output a merge killed between its renames hid, and goes back: test_removal's killed-merge test)
    unmarked = tmp_path / f".out.old-{host}-{dead.pid}"
    from fsdp_recipes.removal import make_folder

    for folder in (stale, live, not_ours):
        # as a merge makes its staging folder
        make_folder(folder, "merge staging")
        (folder / "model.safetensors").write_bytes(b"partial")
    unmarked.mkdir()
    (unmarked / "notes.txt").write_bytes(b"theirs")
    said = []
    merge_checkpoint(checkpoint, tmp_path / "out", log=said.append)
    assert not stale.exists() and live.exists() and not_ours.exists() and unmarked.exists()
    assert f"removed {stale}, left by a merge that was killed (process {dead.pid})" in said


def test_output_on_another_filesystem_by_either_process_and_without_o_direct(checkpoint, tmp_path, monkeypatch):
    """Checkpoints on one filesystem, the model written to another (tmpfs here); written by the copy process (a merge
    whose check runs beside the copy) or by this one; and where the platform has no O_DIRECT or no preadv (macOS), or
    the filesystem refuses O_DIRECT at open: the same bytes, through the page cache."""
    import errno

    import fsdp_recipes.ckpt.merge as merge
    import fsdp_recipes.ckpt.safetensors_writer as writer
    import fsdp_recipes.direct_writes as direct_writes

    children = []
    real_start = writer._start_copies
    monkeypatch.setattr(writer, "_start_copies", lambda files: children.append(files) or real_start(files))
    reference = tmp_path / "same-fs"
    merge_checkpoint(checkpoint, reference, log=lambda *_: None)
    assert len(children) == 1 and children[0], "the merge beside its check did not use the copy process"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        out = Path(tempfile.mkdtemp(dir=shm)) / "merged"
        try:
            merge_checkpoint(checkpoint, out, log=lambda *_: None)
            assert folder_bytes(out) == folder_bytes(reference)
        finally:
            shutil.rmtree(out.parent)
    in_process = lambda *args, **kwargs: writer.write_weights(*args, **{**kwargs, "copy_process": False})  # noqa: E731
    started = len(children)
    monkeypatch.setattr(merge, "write_weights", in_process)
    merge_checkpoint(checkpoint, tmp_path / "in-process", log=lambda *_: None)
    monkeypatch.setattr(direct_writes, "O_DIRECT", 0)
    monkeypatch.delattr(os, "preadv")
    merge_checkpoint(checkpoint, tmp_path / "no-o-direct", log=lambda *_: None)
    monkeypatch.undo()
    monkeypatch.setattr(merge, "write_weights", in_process)
    monkeypatch.setattr(writer, "_start_copies", lambda files: children.append(files) or real_start(files))
    real_open = os.open

    def no_direct_open(path, flags, *args):
        if flags & direct_writes.O_DIRECT:
            # tmpfs before Linux 6.6, some FUSE mounts
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    merge_checkpoint(checkpoint, tmp_path / "refused", log=lambda *_: None)
    monkeypatch.undo()
    # the merges after the first wrote in this process
    assert len(children) == started
    for folder in ("in-process", "no-o-direct", "refused"):
        assert folder_bytes(tmp_path / folder) == folder_bytes(reference), folder


def test_the_output_is_on_disk_before_it_is_renamed_into_place(checkpoint, tmp_path, monkeypatch):
    """Every file of the finished staging folder is fsynced before the rename that publishes it, and the rename
    itself after: a crash cannot leave a model folder that looks complete with empty or torn files."""
    import fsdp_recipes.ckpt.merge as merge

    events = []
    real_sync, real_entries, real_move = merge.sync_folder, merge.sync_entries, merge.move
    monkeypatch.setattr(
        merge,
        "sync_folder",
        lambda p: events.append(("files", Path(p), sorted(q.name for q in Path(p).iterdir()))) or real_sync(p),
    )
    monkeypatch.setattr(merge, "sync_entries", lambda p: events.append(("entries", Path(p))) or real_entries(p))
    monkeypatch.setattr(merge, "move", lambda a, b: events.append(("move", Path(a), Path(b))) or real_move(a, b))
    out = tmp_path / "out"
    merge_checkpoint(checkpoint, out, log=lambda *_: None)
    kinds = [e[0] for e in events]
    # the staging folder's own entries after its marker left
    assert kinds == ["files", "entries", "move", "entries"], events
    (_, staged, files), (_, unmarked), (_, moved, target), (_, parent) = events
    assert staged == unmarked == moved and target == out and parent == out.parent
    # every published file was in the folder fsynced
    assert set(files) >= {p.name for p in out.iterdir()}


def test_the_copy_process_runs_this_package_whatever_the_current_folder(checkpoint, tmp_path, monkeypatch):
    """Merging from a folder that holds another fsdp_recipes (another checkout, an older copy) or a module named as
    one of the standard library's: the copy process imports the package the merge runs and the standard library, not
    those (``python -m`` and ``-c`` put the current folder first on the path)."""
    import fsdp_recipes.ckpt.safetensors_writer as writer

    decoy = tmp_path / "elsewhere" / "fsdp_recipes"
    (decoy / "ckpt").mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit('the decoy package was imported')\n")
    (decoy / "ckpt" / "__init__.py").write_text("")
    (decoy.parent / "json.py").write_text("raise SystemExit('a json.py in the current folder was imported')\n")
    children = []
    real_start = writer._start_copies
    monkeypatch.setattr(writer, "_start_copies", lambda files: children.append(files) or real_start(files))
    monkeypatch.chdir(decoy.parent)
    merge_checkpoint(checkpoint, tmp_path / "out", log=lambda *_: None)
    assert children
    monkeypatch.chdir(tmp_path)
    merge_checkpoint(checkpoint, tmp_path / "reference", log=lambda *_: None)
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "reference")


def test_the_copy_process_is_started_as_isolated_as_the_merge_and_names_a_failed_file(checkpoint, tmp_path):
    """``python -I`` (or -E) ignores PYTHONPATH in the merge: in its copy process too (a json.py on PYTHONPATH was
    imported there alone). A write the copy process cannot make (a file size limit here) is one line naming the
    file, and nothing is published."""
    import resource
    import subprocess
    import sys

    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "json.py").write_text("raise SystemExit('a json.py on PYTHONPATH was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(decoy)}
    for flag in ("-I", "-E"):
        out = tmp_path / f"out{flag}"
        proc = subprocess.run(
            [sys.executable, flag, str(TOOL), str(checkpoint), str(out)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        AutoModelForCausalLM.from_pretrained(out)

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = subprocess.run(
        [sys.executable, str(TOOL), str(checkpoint), str(tmp_path / "limited")],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        cwd=tmp_path,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Writing weights" not in line]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert (
        lines[0].startswith("merge_checkpoint.py: error: ")
        and "model.safetensors: File too large: nothing was published" in lines[0]
    ), lines[0]
    assert not (tmp_path / "limited").exists() and not list(tmp_path.glob(".limited*"))
    # the same limit met by this process's own writer (a cast is no byte copy): the line names the file too
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(checkpoint), str(tmp_path / "limited"), "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        cwd=tmp_path,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Writing weights" not in line]
    assert (
        proc.returncode == 1 and len(lines) == 1 and "File too large" in lines[0] and "model.safetensors" in lines[0]
    ), proc.stderr[-2000:]
    assert not (tmp_path / "limited").exists() and not list(tmp_path.glob(".limited*"))


def test_ctrl_c_during_a_merge_is_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the copy process runs: exit 130, one line, no output, no staging folder, no copy process left."""
    import fsdp_recipes.ckpt.safetensors_writer as writer

    started = []

    def interrupted(child, *args):
        started.append(child)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_finish_copies", interrupted)
    assert cli_main([str(checkpoint), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "merge_checkpoint.py: interrupted: nothing was published"
    # the copy process was stopped, not left running
    assert started and started[0].poll() is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def sigterm_self() -> None:
    """SIGTERM to this process, as a scheduler sends it: the tool's handler raises out of the sleep."""
    import signal
    import time

    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    raise AssertionError("SIGTERM was not handled")


def test_sigterm_during_a_merge_is_one_line_and_leaves_nothing(checkpoint, tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's stop, `timeout`) while the copy process runs unwinds as Ctrl-C does: exit 143, one line,
    no output, no staging folder, no copy process; the caller's own SIGTERM handler is back afterwards. (The process
    died at once before, and its staging folder and copy process were left until the next merge.)"""
    import signal

    import fsdp_recipes.ckpt.safetensors_writer as writer

    started = []

    def stopped(child, *args):
        started.append(child)
        sigterm_self()

    monkeypatch.setattr(writer, "_finish_copies", stopped)
    mine = lambda signum, frame: None  # noqa: E731
    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert cli_main([str(checkpoint), str(tmp_path / "out")]) == 143
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == "merge_checkpoint.py: stopped by SIGTERM: nothing was published"
    )
    assert started and started[0].poll() is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_stopped_merge_does_not_wait_for_the_check_beside_its_copy(checkpoint, tmp_path, monkeypatch, capsys):
    """SIGTERM during the copy: the tool says so and returns once its cleanup is done, while the check beside the
    copy (transformers' imports: seconds, more on a loaded machine) still runs; it writes nothing. The merge waited
    for that check before, and a stopped merge sat out those seconds of a scheduler's grace period."""
    import threading
    import time

    import fsdp_recipes.ckpt.merge as merge_module
    import fsdp_recipes.ckpt.safetensors_writer as writer

    release = threading.Event()
    real = merge_module.describe_with_transformers

    def slow_check(*args):
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(merge_module, "describe_with_transformers", slow_check)
    monkeypatch.setattr(writer, "_finish_copies", lambda *args: sigterm_self())
    # what the merge waited for before
    timer = threading.Timer(10, release.set)
    timer.start()
    start = time.monotonic()
    try:
        assert cli_main([str(checkpoint), str(tmp_path / "out")]) == 143
        took = time.monotonic() - start
    finally:
        release.set()
        timer.cancel()
    assert took < 5, f"the stopped merge took {took:.1f} s: it waited for the check"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "merge_checkpoint.py: stopped by SIGTERM: nothing was published"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize(
    "at, where", [("sync_folder", "staging"), ("sync_entries", "staging"), ("sync_entries", "parent")]
)
def test_sigterm_while_publishing_says_what_happened(checkpoint, tmp_path, monkeypatch, capsys, at, where):
    """SIGTERM while the finished folder is synced: the folder is ours (marked) until it is synced, so the cleanup
    leaves no whole model in .out.tmp-*; SIGTERM after the rename into place says the output is whole, not that
    nothing was published."""
    import signal

    import fsdp_recipes.ckpt.merge as merge_module

    real = getattr(merge_module, at)
    calls = []

    def stopped(folder):
        real(folder)
        if (Path(folder) == tmp_path) == (where == "parent") and not calls:
            calls.append(folder)
            sigterm_self()

    monkeypatch.setattr(merge_module, at, stopped)
    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGTERM)
    assert cli_main([str(checkpoint), str(out)]) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    # the finished folder, unmarked or not, was never renamed into place: removed
    if where == "staging":
        assert last == "merge_checkpoint.py: stopped by SIGTERM: nothing was published" and not out.exists()
    else:
        assert last == f"merge_checkpoint.py: stopped by SIGTERM after {out} was written whole and moved into place", (
            last
        )
        AutoModelForCausalLM.from_pretrained(out)


def _tool():
    spec = importlib.util.spec_from_file_location("merge_checkpoint_cli", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.slow
def test_stops_at_each_call_the_tool_makes_end_in_one_of_its_outcomes(checkpoint, tmp_path, capsys):
    """SIGTERM at each call the tool's main makes while its handler is in place (a signal's handler runs at whichever
    call comes next: the handing back of the caller's handlers is a moment too), alone or after a Ctrl-C during the
    merge: main returns 143 or 130 with one line saying whether the output was published, also where the stop landed
    in a weakref callback the garbage collector ran, whose exception Python drops; nothing raises out of main, no
    staging folder is left and the caller's handlers are handed back."""
    import signal

    tool = _tool()
    own = {tool.main.__code__, tool._merge.__code__, tool._hand_back.__code__}
    # the caller's own handler: a SIGTERM after main handed it back is the caller's
    callers = []

    # (exit code, calls seen)
    def run(out: Path, term_at: int, interrupt_at: int = -1) -> tuple[int, list[str]]:
        seen = []

        def profile(frame, event, arg):
            nonlocal seen
            caller = frame if event == "c_call" else frame.f_back
            if event in ("call", "c_call") and caller is not None and caller.f_code in own:
                if signal.getsignal(signal.SIGTERM) is tool._stopped:
                    if len(seen) in (term_at, interrupt_at):
                        os.kill(os.getpid(), signal.SIGTERM if len(seen) == term_at else signal.SIGINT)
                    seen.append(getattr(arg, "__name__", "?") if event == "c_call" else frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            return tool.main([str(checkpoint), str(out)]), seen
        finally:
            sys.setprofile(None)

    # an xdist worker's is SIG_IGN
    callers_sigint = signal.getsignal(signal.SIGINT)
    before = signal.signal(signal.SIGTERM, lambda signum, frame: callers.append(signum))
    try:
        code, names = run(tmp_path / "whole", -1)
        # a Ctrl-C there: the merge under way
        calls, merging = len(names), names.index("merge_checkpoint")
        assert code == 0 and calls > 3 and names[-1] == "signal", (code, names)
        runs = [(at, -1) for at in range(calls)] + [(at, merging) for at in range(merging + 1, calls)]
        outcomes = []
        for i, (at, interrupt_at) in enumerate(runs):
            out = tmp_path / f"out{i}"
            code, _ = run(out, at, interrupt_at)
            output = capsys.readouterr()
            assert signal.getsignal(signal.SIGTERM) is not tool._stopped, (at, interrupt_at)
            signal.signal(signal.SIGTERM, lambda signum, frame: callers.append(signum))
            assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".out{i}.")], at
            last = output.err.strip().splitlines()[-1] if output.err.strip() else ""
            what = "interrupted" if interrupt_at >= 0 else "stopped by SIGTERM"
            published = f" after {out} was written whole and moved into place" if out.exists() else ""
            said = f"merge_checkpoint.py: {what}{published or ': nothing was published'}"
            assert (code, last) == (130 if interrupt_at >= 0 else 143, said), (at, code, output.err)
            assert signal.getsignal(signal.SIGINT) is callers_sigint, (at, interrupt_at)
            if out.exists():
                whole = load_file(tmp_path / "whole" / "model.safetensors")
                assert load_file(out / "model.safetensors").keys() == whole.keys()
            outcomes.append((code, out.exists()))
        assert {(143, False), (143, True), (130, False)} <= set(outcomes), outcomes
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
    "signame, code, what", [("SIGTERM", 143, "stopped by SIGTERM"), ("SIGINT", 130, "interrupted")]
)
def test_a_stop_python_drops_inside_a_finalizer_still_ends_the_tool_stopped(
    tmp_path, monkeypatch, capsys, signame, code, what
):
    """A handler that runs inside a finalizer has its exception printed and dropped by Python, and the merge goes on
    to the end: the tool still exits as stopped, saying so, with the caller's handlers back."""
    import signal
    from types import SimpleNamespace

    tool = _tool()

    class Finalized:
        def __del__(self):
            # os.kill runs this process's handler before it returns
            os.kill(os.getpid(), getattr(signal, signame))

    def merge(source, output, **kwargs):
        # freed at once: the handler raises inside __del__
        Finalized()
        return SimpleNamespace(output=output, tensors=1, bytes=1, files=["model.safetensors"])

    monkeypatch.setattr(tool, "merge_checkpoint", merge)
    dropped = []
    # where Python reports what it dropped
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert tool.main([str(tmp_path / "in"), str(tmp_path / "out")]) == code
    assert [type(d.exc_value) for d in dropped] == [tool.Stopped if signame == "SIGTERM" else KeyboardInterrupt]
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"merge_checkpoint.py: {what}: nothing was published"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.parametrize("error", [RuntimeError, MemoryError, ValueError, TypeError])
def test_an_unexpected_error_of_the_merge_hands_the_callers_handler_back(tmp_path, monkeypatch, error):
    import signal

    tool = _tool()

    def fails(*args, **kwargs):
        raise error("not one of the merge's own errors")

    monkeypatch.setattr(tool, "merge_checkpoint", fails)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(error):
        tool.main([str(tmp_path / "in"), str(tmp_path / "out")])
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def merge_moments(whole: Path) -> dict:
    """Moments of a merge as seen from outside, (staging folder or None, output) -> reached, for the SIGTERM test;
    ``whole``: the output of the first moment's run, whose model.safetensors the later ones compare sizes with."""

    # the size of a file in the staging folder, None while it has none
    def staged(staging, name) -> int | None:
        try:
            return None if staging is None else (staging / name).stat().st_size
        # not yet written, or renamed away meanwhile
        except OSError:
            return None

    return {
        # first: the whole merge, or stopped after it
        "output in place": lambda staging, out: out.exists(),
        # before the tool's handler, mostly: the signal's default, -15
        "at its start": lambda staging, out: True,
        # not yet here: "staging folder made". A stop while make_folder makes it (between its mkdir and the end of
        # its marker, or before merge_checkpoint's try) leaves the folder behind: to fix in removal and merge
        "copy under way": lambda staging, out: staged(staging, "model.safetensors") is not None,
        "weights whole, the check still running": lambda staging, out: (
            staged(staging, "model.safetensors") == (whole / "model.safetensors").stat().st_size
        ),
        # the publishing (sync, rename) in between: test_sigterm_while_publishing_says_what_happened, in-process
    }


@pytest.mark.slow
def test_sigterm_at_any_moment_leaves_a_whole_output_or_none(checkpoint, tmp_path):
    """The real tool, SIGTERM at moments spread over a merge: it either finished (exit 0, an output that loads),
    stopped after the output was moved into place (exit 143, saying so, the output whole), or stopped (exit 143,
    one line, no output and no staging folder; or -15 before its handler is in place); never a traceback, never a
    folder left half. Each run is stopped when its moment is seen from outside (merge_moments): fixed delays fell
    in one phase, or after the end, depending on the machine's load."""
    import signal
    import subprocess
    import time

    outcomes = {}
    for i, (moment, reached) in enumerate(merge_moments(tmp_path / "out0").items()):
        out = tmp_path / f"out{i}"
        proc = subprocess.Popen(
            [sys.executable, TOOL, str(checkpoint), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            while proc.poll() is None and not reached(next(tmp_path.glob(f".out{i}.tmp-*"), None), out):
                time.sleep(0.002)
            # nothing, once it has ended
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".out{i}."))
        assert not left, (moment, left)
        assert "Traceback" not in stderr, (moment, stderr)
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if proc.returncode == 0:
            assert f"wrote {out}" in stdout and (out / "config.json").is_file(), (moment, stdout)
            AutoModelForCausalLM.from_pretrained(out)
            outcomes[moment] = "finished"
        elif proc.returncode == 143 and out.exists():
            assert last == f"merge_checkpoint.py: stopped by SIGTERM after {out} was written whole and moved into place"
            AutoModelForCausalLM.from_pretrained(out)
            outcomes[moment] = "stopped, published"
        else:
            assert proc.returncode in (143, -signal.SIGTERM), (moment, proc.returncode, stderr)
            assert not out.exists(), moment
            # after the handler is in place: one line
            if proc.returncode == 143:
                assert last == "merge_checkpoint.py: stopped by SIGTERM: nothing was published", (moment, stderr)
            outcomes[moment] = "stopped" if proc.returncode == 143 else "killed before its handler"
    # the moments met a merge under way
    assert "stopped" in outcomes.values(), outcomes


def test_the_copy_process_fails_in_one_line_and_publishes_nothing(checkpoint, trained, tmp_path, monkeypatch):
    """A record cut short after the checks (between them and the copy): the copy process stops with one line naming
    the file, no output folder and no staging folder are left; a copy process that exits 0 without its files whole,
    or is killed by a signal: the same, one line."""
    import fsdp_recipes.ckpt.safetensors_writer as writer

    real_start = writer._start_copies

    def truncate_first(files):
        src, offset, count, *_ = max((piece for f in files for piece in f["pieces"]), key=lambda piece: piece[2])
        # the record's bytes end halfway
        os.truncate(src, offset + count // 2)
        return real_start(files)

    monkeypatch.setattr(writer, "_start_copies", truncate_first)
    with pytest.raises(
        CheckpointError, match=r"\.distcp ended early: the file is truncated; copy the checkpoint again$"
    ):
        merge_checkpoint(checkpoint, tmp_path / "out", log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]

    def killed(files):
        child, errors = real_start(files)
        child.kill()
        return child, errors

    shutil.copytree(
        trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", checkpoint, dirs_exist_ok=True
    )
    # a copy process that writes nothing, exit 0
    monkeypatch.setattr(writer, "_start_copies", lambda files: real_start([]))
    with pytest.raises(
        CheckpointError,
        match=r"^the copy process ended without writing model\.safetensors whole \(None of \d+ bytes\): nothing "
        r"was published",
    ):
        merge_checkpoint(checkpoint, tmp_path / "out", log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    monkeypatch.setattr(writer, "_start_copies", killed)
    with pytest.raises(
        CheckpointError, match=r"^the copy process ended with status -9: nothing was published; run the merge again$"
    ):
        merge_checkpoint(checkpoint, tmp_path / "out", log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
def test_a_failed_check_stops_the_copy(synthetic, tmp_path):
    """The check running beside the copy is asked between pieces of COPY_STEP bytes: once it fails, nothing more
    is copied."""
    from fsdp_recipes.ckpt.copier import COPY_STEP
    from fsdp_recipes.ckpt.readers import DCPSource
    from fsdp_recipes.ckpt.safetensors_writer import Cancelled, write_weights

    ckpt = synthetic[1]
    assert sum(f.stat().st_size for f in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) > 3 * COPY_STEP
    source = DCPSource(ckpt / "pytorch_model_fsdp_0")
    asked = []
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Cancelled):
        write_weights(source, sorted(source.tensors), out, cancelled=lambda: asked.append(1) or len(asked) > 1)
    written = sum(os.stat(p).st_blocks * 512 for p in out.iterdir())
    assert written <= 2 * COPY_STEP, written
