"""A config.json that cannot describe the checkpoint's weights is refused before the model is built from it:
building takes time and memory in proportion to the layer (and expert) count, and ``num_hidden_layers: 1e9`` grew a
merge to 15 GB while no signal stopped it."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import REPO, cli, run_dir  # noqa: F401 (run_dir: the fixture)
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.ckpt.description import implausible_config
from fsdp_recipes.ckpt.readers import TensorInfo

TINY = REPO / "assets" / "tiny-llama"


def weights(layers: int, experts: int = 0, fused: int = 0) -> dict:
    names = {"model.embed_tokens.weight": TensorInfo((256, 64), "float32")}
    for i in range(layers):
        names[f"model.layers.{i}.self_attn.q_proj.weight"] = TensorInfo((64, 64), "float32")
        for e in range(experts):
            names[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = TensorInfo((128, 64), "float32")
        if fused:
            names[f"model.layers.{i}.mlp.experts.gate_up_proj"] = TensorInfo((fused, 64, 256), "float32")
    return names


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_a_config_of_as_many_layers_as_the_weights_or_fewer_is_left_to_the_weight_check(layers):
    config = AutoConfig.from_pretrained(TINY, num_hidden_layers=layers)
    assert implausible_config(config, weights(4)) is None


@pytest.mark.parametrize("layers", [5, 64, 10**9])
def test_more_layers_than_the_weights_number_is_refused(layers):
    config = AutoConfig.from_pretrained(TINY, num_hidden_layers=layers)
    assert (
        implausible_config(config, weights(4))
        == f"config.json says num_hidden_layers {layers}, and the weights' layers are numbered up to 3"
    )


@pytest.mark.parametrize("key", ["num_local_experts", "num_experts", "n_routed_experts"])
def test_experts_beyond_any_the_weights_hold_are_refused_numbered_or_fused(key):
    config = AutoConfig.from_pretrained(TINY, num_hidden_layers=2)
    setattr(config, key, 8)
    assert implausible_config(config, weights(2, experts=8)) is None
    assert implausible_config(config, weights(2, fused=8)) is None
    setattr(config, key, 10**6)
    for held in (weights(2, experts=8), weights(2, fused=8)):
        assert (
            implausible_config(config, held)
            == f"config.json says {key} {10**6}, more than any number of experts the weights hold"
        )


def test_a_nested_text_config_is_checked_too():
    config = AutoConfig.from_pretrained(TINY, num_hidden_layers=2)
    config.text_config = AutoConfig.from_pretrained(TINY, num_hidden_layers=10**9)
    assert "num_hidden_layers 1000000000" in implausible_config(config, weights(2))


def test_the_merge_refuses_it_at_once_and_leaves_nothing(run_dir, tmp_path, capsys):  # noqa: F811
    ckpt = run_dir / "checkpoint-12"
    # as another tool's checkpoint: nothing recorded
    (ckpt / "model_description.json").unlink()
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    began = time.monotonic()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")]) == 1
    # after the copy's progress bar (it starts beside the check)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("merge_checkpoint.py: error: "), err
    assert "config.json says num_hidden_layers 1000000000" in err and "pass --base-model" in err, err
    assert time.monotonic() - began < 60 and not (tmp_path / "out").exists()
    # no staging folder left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_every_count_of_layers_in_every_nested_config_is_checked():
    """bart's decoder_layers (num_hidden_layers maps to encoder_layers) and a vision tower's depth or
    num_hidden_layers are checked too: unchecked, 10^6 decoder layers ran ~10 minutes past a SIGTERM."""
    bart = AutoConfig.for_model("bart", encoder_layers=1, decoder_layers=10**6, vocab_size=256, d_model=64)
    assert "decoder_layers 1000000" in implausible_config(bart, weights(2))
    config = AutoConfig.from_pretrained(TINY, num_hidden_layers=2)
    config.vision_config = {"model_type": "siglip_vision_model", "num_hidden_layers": 3000}
    assert (
        implausible_config(config, weights(2))
        == "config.json says vision_config.num_hidden_layers 3000, and the weights' layers are numbered up to 1"
    )
    config.vision_config = {"model_type": "qwen2_vl", "depth": 3000}
    assert "vision_config.depth 3000" in implausible_config(config, weights(2))


def test_a_threshold_named_like_layers_is_no_count():
    """Qwen2's max_window_layers (a threshold, may exceed the layer count) is not read as one."""
    config = AutoConfig.from_pretrained(TINY, num_hidden_layers=2)
    config.max_window_layers = 70
    config.num_nextn_predict_layers = 9
    assert implausible_config(config, weights(2)) is None


def _checkpoint(folder, form: str, head_is_embeddings: bool, tie_in_config: bool):
    """A manifest-less checkpoint of the tiny Llama with a stored head (its own values, or the embeddings'), in one
    of the forms other tools write, with a config.json stating the tie or not."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)).state_dict()
    if head_is_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    folder.mkdir()
    if form == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    elif form == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(
            {"model": state}, storage_writer=dcp.FileSystemWriter(str(folder / "pytorch_model_fsdp_0")), no_dist=True
        )
    AutoConfig.from_pretrained(TINY, tie_word_embeddings=tie_in_config).save_pretrained(folder)
    return state


@pytest.mark.parametrize("form", ["safetensors", "dcp"])
@pytest.mark.parametrize("how", ["config.json", "--base-model"])
def test_a_tie_the_stored_head_does_not_hold_is_refused_and_a_true_one_merges(tmp_path, capsys, form, how):
    """A head stored with its own values under a config that ties it to the embeddings (config.json edited, or a
    --base-model of a tied model): the merge writes a tied weight once, so the head would be dropped and the model
    would compute with the embeddings. Refused in one line, nothing written; a head equal to the embeddings merges."""
    from safetensors.torch import load_file

    tied_base = tmp_path / "tied-base"
    AutoConfig.from_pretrained(TINY, tie_word_embeddings=True).save_pretrained(tied_base)
    extra = ["--base-model", str(tied_base)] if how == "--base-model" else []
    for head_is_embeddings in (False, True):
        ckpt, out = tmp_path / f"ckpt-{head_is_embeddings}", tmp_path / f"out-{head_is_embeddings}"
        state = _checkpoint(ckpt, form, head_is_embeddings, tie_in_config=how == "config.json")
        code = cli("merge_checkpoint", [str(ckpt), str(out), *extra])
        said = capsys.readouterr()
        if head_is_embeddings:
            assert code == 0, said.err[-2000:]
            merged = load_file(out / "model.safetensors")
            assert "lm_head.weight" not in merged and torch.equal(
                merged["model.embed_tokens.weight"], state["model.embed_tokens.weight"]
            )
        else:
            assert code == 1 and not out.exists(), said.out[-2000:]
            assert "ties lm_head.weight to model.embed_tokens.weight" in said.err, said.err[-2000:]
