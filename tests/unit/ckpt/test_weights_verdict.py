"""A checkpoint's verdict comes from its weights: each safetensors header entry checked as safetensors itself checks it
(dtype x shape = its bytes, no two over the same bytes, no gap, the file exactly as long), the tensors against the
index and the config beside them; never from whether another file (trainer_state.json) parses. Weights that pass are
a model: --overwrite_output_dir never deletes them, whatever trainer_state.json holds. Weights that lie are refused
everywhere in one line (check_checkpoint, the merge, a model folder given to a run), where safetensors and
from_pretrained would refuse them or, worse, read one tensor as a copy of another. NaN or infinite values are the
merge's to find (it reads every byte): it refuses them, naming the tensor.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
from conftest import REPO, cli, one_line_error

from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE
from fsdp_recipes.ckpt.resume import check_output_dir
from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.removal import make_folder

TINY = REPO / "assets" / "tiny-llama"
STEP = 4


@pytest.fixture(scope="session")
def saves(tmp_path_factory) -> dict[str, Path]:
    """What the stock Trainer's save_only_model writes (save_pretrained, then trainer_state.json): one folder as a
    single safetensors file, one as shards and their index."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerState

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    saves = {}
    for kind, shard in (("single", None), ("sharded", "200KB")):
        folder = tmp_path_factory.mktemp(kind) / f"checkpoint-{STEP}"
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        TrainerState(global_step=STEP).save_to_json(str(folder / "trainer_state.json"))
        saves[kind] = folder
    return saves


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def forge(folder: Path, edit) -> None:
    """``edit(header, data) -> (header, data)`` applied to folder/model.safetensors."""
    header, data = read_header(folder / "model.safetensors")
    write_header(folder / "model.safetensors", *edit(header, data))


def _entry(header: dict, name: str = "lm_head.weight") -> dict:
    return header[name]


def _last(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


# embed_tokens read from lm_head's bytes: a copy of it, where safetensors says "invalid offset"
def _overlap(h, d):
    h["model.embed_tokens.weight"]["data_offsets"] = list(h["lm_head.weight"]["data_offsets"])
    return h, d


# 1000x1000 float32 in 4 bytes, as the last tensor
def _huge(h, d):
    last = _last(h)
    begin = h[last]["data_offsets"][0]
    h[last] = {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [begin, begin + 4]}
    return h, d[: begin + 4]


# the last tensor moved on by 4 bytes nobody accounts for
def _gap(h, d):
    last = _last(h)
    begin, end = h[last]["data_offsets"]
    h[last]["data_offsets"] = [begin + 4, end + 4]
    return h, d[:begin] + b"\0" * 4 + d[begin:]


def _tail(h, d):
    return h, d + b"\0" * 64


# a shape whose bytes are fewer than its offsets span
def _fewer_elements(h, d):
    last = _last(h)
    h[last]["shape"] = [1]
    return h, d


def _reversed(h, d):
    last = _last(h)
    h[last]["data_offsets"] = h[last]["data_offsets"][::-1]
    return h, d


def _dtype(h, d):
    h[_last(h)]["dtype"] = "F33"
    return h, d


def _dtype_not_text(h, d):
    h[_last(h)]["dtype"] = ["F32"]
    return h, d


# F32 bytes said to be F16: half of them
def _other_dtype_size(h, d):
    h[_last(h)]["dtype"] = "F16"
    return h, d


def _negative_shape(h, d):
    last = _last(h)
    h[last]["shape"] = [-h[last]["shape"][0], *h[last]["shape"][1:]]
    return h, d


def _metadata(h, d):
    h["__metadata__"] = {"format": 1}
    return h, d


HEADER_LIES = {
    "two tensors over the same bytes": _overlap,
    "1000x1000 in 4 bytes": _huge,
    "a gap before a tensor": _gap,
    "bytes after the last tensor": _tail,
    "a shape of fewer elements than its bytes": _fewer_elements,
    "offsets end before they begin": _reversed,
    "a dtype safetensors does not know": _dtype,
    "a dtype that is not text": _dtype_not_text,
    "a dtype of another size": _other_dtype_size,
    "a negative dimension": _negative_shape,
    "metadata that is not text": _metadata,
}


def weights_only(saves, run: Path, kind: str = "single") -> Path:
    ckpt = run / f"checkpoint-{STEP}"
    shutil.copytree(saves[kind], ckpt)
    return ckpt


def error_line(stderr: str) -> str:
    """The merge's one error line (beside tqdm's progress, which a merge that got as far as the copy drew)."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and "Writing weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("merge_checkpoint.py: error: "), stderr
    return lines[0]


def safetensors_refuses(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return False
    except Exception:  # noqa: BLE001 (SafetensorError, or a Python error on what is no header at all)
        return True


@pytest.mark.parametrize("lie", sorted(HEADER_LIES))
def test_a_header_safetensors_refuses_is_refused_everywhere_in_one_line(saves, tmp_path, lie, capsys):
    ckpt = weights_only(saves, tmp_path / "run")
    forge(ckpt, HEADER_LIES[lie])
    # the bar this check meets
    assert safetensors_refuses(ckpt / "model.safetensors")
    status = checkpoint_status(ckpt)
    assert not status.weights_only and status.problems, status
    assert status.problems[0].startswith("model weights: model.safetensors "), status.problems
    assert "WEIGHTS ONLY" not in status.summary() and "\n" not in status.summary()
    # the merge: one line, nothing written (it wrote embed_tokens as a copy of lm_head)
    out = tmp_path / "merged"
    assert cli("merge_checkpoint", [str(ckpt), str(out)]) == 1
    err = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "model.safetensors" in err and "copy the checkpoint again" in err, err
    assert not out.exists()
    # a run given the folder as its model: one line before anything starts, not a traceback on rank 0
    from fsdp_recipes.config.model_source import model_source_problem

    said = model_source_problem(str(ckpt), weights=True)
    assert said is not None and "model.safetensors" in said and "\n" not in said, said


def _index_names_one(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"] = {first: index["weight_map"][first]}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


# the same bytes, the dimensions swapped: every byte accounted for
def _wrong_shape(ckpt: Path) -> None:
    def edit(h, d):
        entry = h["model.layers.0.mlp.up_proj.weight"]
        entry["shape"] = entry["shape"][::-1]
        return h, d

    forge(ckpt, edit)


# F32 bytes relabelled I32: the same size, huge values, no NaN
def _integers(ckpt: Path) -> None:
    def edit(h, d):
        h["model.layers.0.self_attn.q_proj.weight"]["dtype"] = "I32"
        return h, d

    forge(ckpt, edit)


def _renamed(ckpt: Path) -> None:
    def edit(h, d):
        h["lm_head.weights"] = h.pop("lm_head.weight")
        return h, d

    forge(ckpt, edit)


def _other_config(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 128
    (ckpt / "config.json").write_text(json.dumps(config))


def _fewer_layers(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (ckpt / "config.json").write_text(json.dumps(config))


def _no_tensors(ckpt: Path) -> None:
    write_header(ckpt / "model.safetensors", {"__metadata__": {"format": "pt"}}, b"")


# headers safetensors reads, of weights that are not the model the folder describes
NOT_THE_MODEL = {
    "an index naming one tensor of many": ("sharded", _index_names_one, "the index is not this checkpoint's"),
    "a shape of the same bytes swapped": ("single", _wrong_shape, "describes another model"),
    "a renamed tensor": ("single", _renamed, "describes another model"),
    "a float weight's bytes said to be integers": ("single", _integers, "is stored as I32"),
    "a config of another width": ("single", _other_config, "describes another model"),
    "a config of fewer layers": ("single", _fewer_layers, "describes another model"),
    "no tensors": ("single", _no_tensors, "hold no tensors"),
}


@pytest.mark.parametrize("case", sorted(NOT_THE_MODEL))
def test_weights_that_are_not_the_model_beside_them_are_not_called_complete(saves, tmp_path, case, capsys):
    kind, damage, words = NOT_THE_MODEL[case]
    ckpt = weights_only(saves, tmp_path / "run", kind)
    damage(ckpt)
    status = checkpoint_status(ckpt)
    assert not status.weights_only and any(words in p for p in status.problems), status.problems
    assert "WEIGHTS ONLY" not in status.summary() and "\n" not in status.summary()
    assert cli("check_checkpoint", [str(ckpt)]) == 1
    said = capsys.readouterr().out
    assert "INCOMPLETE: model weights: " in said and words in said, said


# trainer_state.json beside whole weights, as a careless copy or a hostile user leaves it
TRAINER_STATES = {
    "a list": "[]",
    "null": "null",
    "cut short": '{"global_step": 4, "log_hist',
    "empty": "",
    "a string": '"checkpoint"',
    "missing": None,
}


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("state", sorted(TRAINER_STATES))
def test_whole_weights_are_never_deleted_whatever_trainer_state_holds(saves, tmp_path, state):
    """--overwrite_output_dir deleted these weights when trainer_state.json was [], null, cut short or empty (and a
    save of ours without it), and kept the same folder with {}: the verdict now reads the weights alone."""
    run = tmp_path / "run"
    # a run of ours made it: its marker
    ckpt = make_folder(run / f"checkpoint-{STEP}", CHECKPOINT_PURPOSE)
    shutil.copytree(saves["single"], ckpt, dirs_exist_ok=True)
    if TRAINER_STATES[state] is None:
        (ckpt / "trainer_state.json").unlink()
    else:
        (ckpt / "trainer_state.json").write_text(TRAINER_STATES[state])
    status = checkpoint_status(ckpt)
    assert status.weights_only and status.may_be_good and not status.resumable, status
    # said, as what it is
    assert "trainer_state.json" in "; ".join(status.problems)
    before = snapshot(run)
    for overwrite in (False, True):
        with pytest.raises(RecipeError) as caught:
            check_output_dir(str(run), resuming=False, overwrite=overwrite)
        assert "holds model weights only" in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert snapshot(run) == before


# (value written into one weight, --dtype of the merge)
NON_FINITE = {
    "NaN": (float("nan"), None),
    "infinity": (float("inf"), None),
    "NaN cast to bfloat16": (float("nan"), "bfloat16"),
    "a float32 beyond float16": (1e6, "float16"),
}


@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_the_merge_refuses_non_finite_weights_naming_the_tensor(saves, tmp_path, case, capsys):
    from safetensors.torch import load_file, save_file

    value, dtype = NON_FINITE[case]
    ckpt = weights_only(saves, tmp_path / "run")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][3, 5] = value
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "merged"
    assert cli("merge_checkpoint", [str(ckpt), str(out), *(["--dtype", dtype] if dtype else [])]) == 1
    err = error_line(capsys.readouterr().err)
    # finite weights --dtype cannot hold are said to exceed its range, not called NaN
    said = ": its values exceed float16's range" if case == "a float32 beyond float16" else " holds NaN or infinite"
    assert err.startswith(f"merge_checkpoint.py: error: model.layers.1.self_attn.q_proj.weight{said}"), err
    assert not out.exists()


def test_a_copy_without_its_tokenizer_files_merges_and_says_which_are_missing(saves, tmp_path, capsys):
    """A checkpoint our run described (its manifest) copied without its tokenizer: the weights are verified and
    merged, and the missing files named; only a file that is there and differs is refused."""
    from transformers import AutoConfig

    from fsdp_recipes.ckpt.description import seal_manifest, write_manifest

    ckpt = weights_only(saves, tmp_path / "run")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / name, ckpt / name)
    write_manifest(ckpt, AutoConfig.from_pretrained(ckpt), ["config.json", "tokenizer.json", "tokenizer_config.json"])
    seal_manifest(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
    out = tmp_path / "merged"
    assert cli("merge_checkpoint", [str(ckpt), str(out)]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "lacks tokenizer.json, tokenizer_config.json" in said, said
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()
    # changed: refused
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text().replace("64", "64 "))
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "again")]) == 1
    assert "config.json is not as the run wrote it" in capsys.readouterr().err
