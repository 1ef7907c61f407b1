"""tools/merge_checkpoint.py on checkpoints other tools write (tests/helpers/foreign_checkpoints.py: raw torch DCP,
torch's get_state_dict with its optimizer, bf16 weights, Lightning, PEFT LoRA under FSDP2), each from a real
2-process run. Every merge must equal the true weights exactly, with nothing but a config.json to go by."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli, one_line_error, run
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

CASES = ["raw_dcp", "get_state_dict", "bf16", "lightning"]
LAYOUTS = {
    "raw_dcp": "39 weights at the top level (no prefix)",
    "get_state_dict": '39 weights under "model."; 117 other stored tensor(s) ignored',
    "bf16": "39 weights at the top level (no prefix)",
    "lightning": '39 weights under "state_dict.model."; 117 other stored tensor(s) ignored',
}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("foreign")
    proc = run(["python", str(REPO / "tests" / "helpers" / "foreign_checkpoints.py"), str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def config_only(tmp_path_factory) -> Path:
    """What --base-model needs at least: a folder holding only config.json."""
    folder = tmp_path_factory.mktemp("config-only")
    shutil.copy(REPO / "assets" / "tiny-llama" / "config.json", folder)
    return folder


def assert_equal_weights(folder: Path, truth: Path, file: str = "model.safetensors"):
    got, want = load_file(folder / file), load_file(truth)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("case", CASES)
def test_other_tools_checkpoints_merge_to_their_true_weights(corpus, config_only, case, tmp_path, capsys):
    out = tmp_path / "merged"
    assert cli("merge_checkpoint", [str(corpus / case), str(out), "--base-model", str(config_only), "--verify"]) == 0
    said = capsys.readouterr().out
    assert f"layout: {LAYOUTS[case]}" in said and "no tokenizer in" in said, said
    assert_equal_weights(out, corpus / f"{case}.truth.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cli("merge_checkpoint", [str(corpus / case), "--inspect"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert LAYOUTS[case] in info["layout"] and info["tensors"] == 39


def test_config_beside_the_weights_is_found(corpus, tmp_path, capsys):
    copy = tmp_path / "raw"
    shutil.copytree(corpus / "raw_dcp", copy)
    shutil.copy(REPO / "assets" / "tiny-llama" / "config.json", copy)
    assert cli("merge_checkpoint", [str(copy), str(tmp_path / "out")]) == 0
    assert_equal_weights(tmp_path / "out", corpus / "raw_dcp.truth.safetensors")


def test_peft_lora_merged_and_adapter_only(corpus, tmp_path, capsys):
    """The merge equals peft's own merge_and_unload of the trained adapter, bit for bit; --adapter-only writes what
    get_peft_model_state_dict holds, and PeftModel.from_pretrained loads it into the same merged model. The base
    model's config comes from the folder adapter_config.json names."""
    from peft import PeftModel

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert cli("merge_checkpoint", [str(corpus / "peft_lora"), str(merged), "--verify"]) == 0
    said = capsys.readouterr().out
    assert "PEFT LoRA checkpoint: merging adapter 'default' (8 modules, lora_alpha 8)" in said
    assert_equal_weights(merged, corpus / "peft_lora.truth.safetensors")
    assert cli("merge_checkpoint", [str(corpus / "peft_lora"), str(adapter), "--adapter-only"]) == 0
    assert_equal_weights(adapter, corpus / "peft_lora.adapter.safetensors", "adapter_model.safetensors")
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(merged)), adapter
    )
    assert peft_model.peft_config["default"].r == 4
    loaded = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    written = load_file(adapter / "adapter_model.safetensors")
    assert len(loaded) == len(written) == 16
    assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")], v) for k, v in written.items())
    capsys.readouterr()
    # a DoRA adapter config is refused by name, not merged wrong
    dora = tmp_path / "dora"
    shutil.copytree(corpus / "peft_lora", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert cli("merge_checkpoint", [str(dora), str(tmp_path / "x")]) == 1
    assert "DoRA is not supported by this merge" in one_line_error(
        capsys.readouterr().err, "merge_checkpoint.py: error: "
    )
    (dora / "adapter_config.json").unlink()
    assert cli("merge_checkpoint", [str(dora), str(tmp_path / "x")]) == 1
    assert "no adapter_config.json in" in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert not (tmp_path / "x").exists()


def test_stock_trainer_checkpoint_without_config_or_tokenizer(trained, config_only, tmp_path, capsys):
    """The Trainer alone (no tokenizer passed, SHARDED_STATE_DICT) leaves only shards and trainer state."""
    ckpt = tmp_path / "checkpoint-12"
    keep = (
        "pytorch_model_fsdp_0",
        "optimizer_0",
        "scheduler.pt",
        "trainer_state.json",
        "rng_state_0.pth",
        "rng_state_1.pth",
    )
    shutil.copytree(
        trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12",
        ckpt,
        ignore=lambda d, names: [n for n in names if Path(d).name == "checkpoint-12" and n not in keep],
    )
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "a")]) == 1
    err = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "no config.json in" in err and "pass --base-model" in err
    # failed before any copy
    assert not list(tmp_path.glob(".a*"))
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "a"), "--base-model", str(config_only), "--verify"]) == 0


def test_unreadable_layout_names_what_was_found(corpus, config_only, tmp_path, capsys):
    """A config of another model: one line with the first stored names and what was expected; nothing written."""
    other = tmp_path / "other-config"
    other.mkdir()
    config = json.loads((config_only / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps(
            {
                **config,
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "vocab_size": config["vocab_size"],
            }
        )
    )
    assert cli("merge_checkpoint", [str(corpus / "raw_dcp"), str(tmp_path / "out"), "--base-model", str(other)]) == 1
    # transformers' check runs beside the copy, which it stops: the copy's progress bar may precede the one line
    said = [x for x in capsys.readouterr().err.replace("\r", "\n").splitlines() if "Writing weights" not in x]
    err = one_line_error("\n".join(said), "merge_checkpoint.py: error: ")
    assert (
        "weights of GPT2LMHeadModel (e.g. transformer.h.0.attn.c_attn.bias); it stores lm_head.weight, "
        "model.embed_tokens.weight" in err
    ), err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


ACCELERATE_LOOPS = [
    # FSDP1, sharded: pytorch_model_fsdp_0/
    ("accelerate_configs/fsdp1/zero3.yaml", (), 'weights under "model."'),
    # FSDP2, full .bin
    ("accelerate_configs/zero3.yaml", ("--fsdp_state_dict_type", "FULL_STATE_DICT"), "weights at the top level"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config, launch_args, layout", ACCELERATE_LOOPS, ids=["fsdp1-sharded", "fsdp2-full-bin"])
def test_plain_accelerate_loop_save_state(config, launch_args, layout, config_only, tmp_path, capsys):
    """A user's own accelerate loop (no Trainer) and its `accelerator.save_state` folder, beside a random_states
    pickle the merge never reads."""
    from conftest import launch

    state = tmp_path / "state"
    launch(config, str(state), launch_args=launch_args, script=REPO / "tests" / "helpers" / "accelerate_loop.py")
    assert list(state.glob("random_states_*.pkl"))
    assert cli("merge_checkpoint", [str(state), str(tmp_path / "merged"), "--base-model", str(config_only)]) == 0
    assert f"layout: 39 {layout}" in capsys.readouterr().out
    assert_equal_weights(tmp_path / "merged", Path(f"{state}.truth.safetensors"))
