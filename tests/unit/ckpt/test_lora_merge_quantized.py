"""A LoRA checkpoint whose frozen base is quantized (QLoRA under FSDP: bitsandbytes' packed 4-bit weights, 8-bit
weights) merges into the unquantized base model's weights, exactly as peft's merge_and_unload of that base and the
trained adapter; the adapter alone is written as for any LoRA checkpoint. Seen on an H200 (bench/results/h200/
gpu-check-1): the run's final export added lora_B @ lora_A to a packed (4194304, 1) tensor and crashed after training.

bitsandbytes' kernels need CUDA, so the quantized checkpoints here are generated: the real one's names and shapes
(peft's names, the base weight packed into fewer elements of the storage dtype), saved with torch DCP."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, cli, one_line_error
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

# (storage dtype, elements per weight element): 4-bit in bf16 storage (FSDP's QLoRA recipe), 4-bit in uint8, 8-bit
BNB_4BIT = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "bfloat16",
}
PACKINGS = {"4bit-bf16": (torch.bfloat16, 4), "4bit-uint8": (torch.uint8, 2), "8bit-int8": (torch.int8, 1)}


def tiny_peft(seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                # trained: lora_B is no longer zero, so the merge changes the weights
                p.normal_()
    return model


def packed(weight: torch.Tensor, dtype: torch.dtype, per: int) -> torch.Tensor:
    """A stand-in of the stored quantized weight: its element count and dtype, as FSDP saves Params4bit/Int8Params."""
    return (
        torch.randint(0, 100, (weight.numel() // per, 1 if per > 1 else weight.shape[1]), dtype=torch.int16).to(dtype)
        if per > 1
        else torch.randint(-100, 100, weight.shape, dtype=torch.int16).to(dtype)
    )


@pytest.fixture(scope="module")
def base_and_truth(tmp_path_factory):
    """The unquantized base model folder, the trained peft model, and peft's own merge of it."""
    folder = tmp_path_factory.mktemp("qlora")
    model = tiny_peft()
    base_dir = folder / "base"
    # what the run loaded: the base model's own weights (the LoRA modules' base_layer weights unwrapped)
    unwrapped = {
        k.replace("base_model.model.", "", 1).replace(".base_layer.", "."): v
        for k, v in model.state_dict().items()
        if ".lora_" not in k
    }
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))
    plain.load_state_dict(unwrapped)
    plain.save_pretrained(base_dir)
    truth = {k: v.clone() for k, v in tiny_peft().merge_and_unload().state_dict().items()}
    return folder, base_dir, model, truth


def quantized_checkpoint(folder, base_dir, model, packing: str):
    dtype, per = PACKINGS[packing]
    state = {}
    for name, value in model.state_dict().items():
        module = name.split(".base_layer.")[0]
        wrapped = name.endswith(".base_layer.weight") and any(
            k.startswith(f"{module}.lora_A.") for k in model.state_dict()
        )
        state[name] = packed(value, dtype, per) if wrapped else value
    ckpt = folder / f"checkpoint-{packing}"
    dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = str(base_dir)
    config["target_modules"] = sorted(config["target_modules"])
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    # the QLoRA run's model config, as the Trainer saves it beside the checkpoint: it says the weights are quantized
    model_config = json.loads((REPO / "assets" / "tiny-llama" / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**model_config, "quantization_config": BNB_4BIT}))
    return ckpt


@pytest.mark.parametrize("packing", PACKINGS)
def test_a_quantized_base_merges_into_the_unquantized_base_as_peft_does(base_and_truth, packing, tmp_path, capsys):
    folder, base_dir, model, truth = base_and_truth
    ckpt = quantized_checkpoint(folder, base_dir, model, packing)
    out = tmp_path / "merged"
    assert cli("merge_checkpoint", [str(ckpt), str(out)]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "(quantized: QLoRA): the adapter is merged into the unquantized base model's weights" in said, said
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(truth)
    for name, value in truth.items():
        assert torch.equal(got[name], value), name
    # the written config says nothing of quantization: from_pretrained loads the merged weights as they are, with
    # no bitsandbytes
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[n], v) for n, v in truth.items())
    adapter = tmp_path / "adapter"
    assert cli("merge_checkpoint", [str(ckpt), str(adapter), "--adapter-only"]) == 0
    written = load_file(adapter / "adapter_model.safetensors")
    lora = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert len(written) == len(lora) > 0
    assert all(torch.equal(lora[k.replace(".weight", ".default.weight")], v) for k, v in written.items())


def test_a_quantized_base_without_its_unquantized_base_is_one_line(base_and_truth, tmp_path, capsys):
    folder, base_dir, model, _ = base_and_truth
    ckpt = quantized_checkpoint(folder, tmp_path / "gone", model, "4bit-bf16")
    # DCP's "single process" warning from making the checkpoint here (shown when this test runs first)
    capsys.readouterr()
    out = tmp_path / "merged"
    assert cli("merge_checkpoint", [str(ckpt), str(out)]) == 1
    error = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "pass --base-model <the folder of the model the adapter was trained on>" in error, error
    assert not out.exists()
    assert cli("merge_checkpoint", [str(ckpt), str(out), "--base-model", str(base_dir)]) == 0


# ---- what must be refused, or kept, around these merges ----


def test_a_quantized_checkpoint_on_another_base_of_the_same_shapes_is_refused(base_and_truth, tmp_path, capsys):
    """Without the run's base_identity.json (a checkpoint of another tool), the weights the run did not quantize are
    the evidence: the embeddings and norms the checkpoint holds must be the base's. A trained norm counts too."""
    folder, base_dir, model, _ = base_and_truth
    other = tmp_path / "other-base"
    from transformers import AutoConfig

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")).save_pretrained(other)
    ckpt = quantized_checkpoint(folder, base_dir, model, "4bit-bf16")
    # DCP's own progress bars
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out"), "--base-model", str(other)]) == 1
    error = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "differs from the base model" in error and "give its base with --base-model" in error, error
    assert not (tmp_path / "out").exists()
    # the right base, but a norm the run trained: merging would put the base's back, silently
    state = dcp_state(ckpt)
    norm = next(k for k in state if k.endswith("input_layernorm.weight"))
    state[norm] *= 3
    trained = write_checkpoint(tmp_path / "trained-norm", state, ckpt)
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(trained), str(tmp_path / "out")]) == 1
    assert norm.split("model.", 1)[1] in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")


def dcp_state(ckpt) -> dict:
    """The model state a DCP checkpoint holds, read by our allow-listed reader (torch's own unpickles byte records)."""
    from fsdp_recipes.ckpt.resolve import resolve_input

    source = resolve_input(ckpt).source
    return {name.removeprefix("model."): tensor.clone() for name, tensor in source.read(list(source.tensors)).items()}


def test_a_quantized_base_model_is_refused_as_the_base(base_and_truth, tmp_path, capsys):
    folder, base_dir, model, _ = base_and_truth
    from safetensors.torch import save_file

    int8_base = tmp_path / "int8-base"
    int8_base.mkdir()
    (int8_base / "config.json").write_bytes((base_dir / "config.json").read_bytes())
    weights = load_file(base_dir / "model.safetensors")
    save_file(
        {k: v.to(torch.int8) if k.endswith("proj.weight") else v for k, v in weights.items()},
        str(int8_base / "model.safetensors"),
    )
    ckpt = quantized_checkpoint(folder, base_dir, model, "8bit-int8")
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out"), "--base-model", str(int8_base)]) == 1
    error = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "is int8: a quantized model" in error and "give the unquantized base with --base-model" in error, error
    assert not (tmp_path / "out").exists()


def test_a_plain_checkpoint_keeps_its_quantization_config(tmp_path, capsys):
    """Only a merge into the unquantized base drops quantization_config: elsewhere the weights written are the
    checkpoint's, and a config that says how they are quantized must stay (without it they load as garbage)."""
    from transformers import AutoConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))
    ckpt = tmp_path / "plain"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    config = json.loads((REPO / "assets" / "tiny-llama" / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": BNB_4BIT}))
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["load_in_4bit"] is True


def refused_lora_merge(tmp_path, capsys, base, target_modules: list[str]) -> str:
    """A trained-looking peft checkpoint of ``base`` with LoRA on ``target_modules``, saved with DCP: the merge's
    one-line error (it must refuse, and write nothing)."""
    from peft import LoraConfig, get_peft_model

    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, checkpoint_id=str(ckpt), no_dist=True)
    adapter = {**model.peft_config["default"].to_dict(), "base_model_name_or_path": str(tmp_path / "base")}
    adapter["target_modules"] = sorted(adapter["target_modules"])
    (ckpt / "adapter_config.json").write_text(json.dumps(adapter))
    (ckpt / "config.json").write_text(base.config.to_json_string())
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    return one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")


def test_lora_on_a_tied_lm_head_is_refused_not_merged_into_one_of_the_two(tmp_path, capsys):
    """peft's merge of an adapter on a tied lm_head changes the one tensor both names share; the merge writes a
    tied weight once, from the embeddings' name, so it would drop the adapter's delta: refused by name."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama", tie_word_embeddings=True)
    )
    error = refused_lora_merge(tmp_path, capsys, base, ["q_proj", "lm_head"])
    assert "lm_head.weight has a LoRA adapter and is tied to the input embeddings" in error, error


def test_inspect_says_the_base_is_quantized(base_and_truth, capsys):
    folder, base_dir, model, _ = base_and_truth
    ckpt = quantized_checkpoint(folder, base_dir, model, "4bit-uint8")
    assert cli("merge_checkpoint", [str(ckpt), "--inspect"]) == 0
    assert "a LoRA adapter on a quantized base" in json.loads(capsys.readouterr().out)["layout"]


@pytest.mark.parametrize(
    "loaded, stored", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float16, torch.float16)]
)
def test_a_quantized_checkpoint_whose_run_rounded_its_fp32_base_merges(
    base_and_truth, loaded, stored, tmp_path, capsys
):
    """A run that loaded an fp32 base in bf16 or fp16 (and FSDP upcast it back to fp32, or kept it) holds rounded
    copies of the unquantized weights, fp16's small values flushed or subnormal: the same base, not another. A NaN
    both hold is the same NaN: the base is recognised, and the merge then refuses the NaN itself, by name."""
    from safetensors.torch import save_file

    folder, base_dir, model, truth = base_and_truth
    state = dcp_state(quantized_checkpoint(folder, base_dir, model, "4bit-bf16"))
    rounded = {
        k: v.to(loaded).to(stored) if v.is_floating_point() and ".lora_" not in k and v.dtype == torch.float32 else v
        for k, v in state.items()
    }
    assert any(not torch.equal(rounded[k].float(), state[k].float()) for k in state)
    ckpt = write_checkpoint(tmp_path / "rounded", rounded, folder / "checkpoint-4bit-bf16")
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out"), "--base-model", str(base_dir)]) == 0, (
        capsys.readouterr().err
    )
    got = load_file(tmp_path / "out" / "model.safetensors")
    # the base's own weights, the adapter merged
    assert all(torch.equal(got[n], v) for n, v in truth.items())

    norm = next(k for k in state if k.endswith("input_layernorm.weight"))
    base = load_file(base_dir / "model.safetensors")
    base_norm = norm.split("base_model.model.", 1)[1]
    # the same NaN in both
    base[base_norm][0] = rounded[norm][0] = float("nan")
    nan_base = tmp_path / "nan-base"
    nan_base.mkdir()
    (nan_base / "config.json").write_bytes((base_dir / "config.json").read_bytes())
    save_file(base, str(nan_base / "model.safetensors"))
    ckpt = write_checkpoint(tmp_path / "rounded-nan", rounded, folder / "checkpoint-4bit-bf16")
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out-nan"), "--base-model", str(nan_base)]) == 1
    error = capsys.readouterr().err
    assert f"{base_norm} holds NaN or infinite values" in error and "differs from the base model" not in error, error


def test_a_base_off_by_less_than_a_rounding_step_is_another_base(base_and_truth, tmp_path, capsys):
    """A base whose unquantized weights differ by 0.5% (a fine-tuned variant) is not the run's: no tolerance lets it
    in."""
    folder, base_dir, model, _ = base_and_truth
    base = load_file(base_dir / "model.safetensors")
    variant = tmp_path / "variant"
    variant.mkdir()
    (variant / "config.json").write_bytes((base_dir / "config.json").read_bytes())
    from safetensors.torch import save_file

    save_file(
        {k: v * 1.005 if not k.endswith("proj.weight") else v for k, v in base.items()},
        str(variant / "model.safetensors"),
    )
    ckpt = quantized_checkpoint(folder, base_dir, model, "4bit-bf16")
    capsys.readouterr()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out"), "--base-model", str(variant)]) == 1
    assert "differs from the base model" in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")


def write_checkpoint(path, state, like):
    dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    for name in ("adapter_config.json", "config.json"):
        (path / name).write_bytes((like / name).read_bytes())
    return path


def test_lora_on_modules_stored_both_ways_is_refused_in_one_line(tmp_path, capsys):
    """peft decides fan_in_fan_out per module (GPT-2's Conv1D stores its weight in x out, a Linear head out x in) and
    records one value: the merge crashed with a RuntimeError on such an adapter; now it refuses it before the copy."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=120, n_positions=64, tie_word_embeddings=False)
    )
    error = refused_lora_merge(tmp_path, capsys, base, ["c_attn", "lm_head"])
    assert "modules stored both ways cannot be merged by one setting" in error, error
