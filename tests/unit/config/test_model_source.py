"""Model folders as users find them (the hub, a colleague, a download): whatever they hold, nothing in them runs or is
unpickled, no file outside them is read, and a folder that cannot be loaded that way is one line before anything
starts, from every entry point that reads a model: train_fsdp.py's arguments, check_config.py, estimate_memory.py,
the launch-time position check and the merge's reader: no folder's `auto_map` code runs, even after transformers'
"run the custom code? [y/N]" prompt is answered yes; no shard index reads /etc/passwd; no .bin is unpickled; no
config of 1,000,000 layers hangs the tools."""

from __future__ import annotations

import ast
import builtins
import functools
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO

from fsdp_recipes.errors import CheckpointError, RecipeError

TINY = REPO / "assets" / "tiny-llama"
CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import {base} as {name}\n"


@pytest.fixture(autouse=True)
def answer_yes(monkeypatch):
    """A user who answers transformers' prompt to run a folder's code with "y": any prompt would run it."""
    monkeypatch.setattr(builtins, "input", lambda *_: "y")


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A tiny Llama saved as save_pretrained writes it (safetensors), with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny") / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(folder)
    return folder


def folder_with_code(root: Path, kind: str) -> Path:
    """A model folder whose config.json (or tokenizer_config.json) names Python files of its own that leave a
    marker when imported: "unknown" (a model_type transformers lacks), "known" (llama plus an auto_map: transformers
    loads its own class and runs nothing), "tokenizer" (a tokenizer class of its own)."""
    folder = root / kind
    shutil.copytree(TINY, folder)
    marker = root / f"RAN-{kind}"
    config = json.loads((folder / "config.json").read_text())
    if kind == "tokenizer":
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        tok.update(
            tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        )
        (folder / "tokenizer_config.json").write_text(json.dumps(tok))
        (folder / "tokenization_evil.py").write_text(
            CODE.format(marker=str(marker), base="PreTrainedTokenizerFast", name="EvilTokenizer")
        )
    else:
        config["auto_map"] = {
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        }
        if kind == "unknown":
            config["model_type"] = "evilmodel"
        (folder / "configuration_evil.py").write_text(
            CODE.format(marker=str(marker), base="LlamaConfig", name="EvilConfig")
        )
        (folder / "modeling_evil.py").write_text(
            CODE.format(marker=str(marker), base="LlamaForCausalLM", name="EvilForCausalLM")
        )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def entry_points(folder: Path, weights_from: Path, tmp_path: Path) -> dict:
    """Each reader of a model a user names: what it said (an error's text, or None when it took the folder)."""
    from fsdp_recipes.config.accelerate_config import check_config
    from fsdp_recipes.config.memory import model_shape
    from fsdp_recipes.config.model_source import model_positions
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.config.problems import errors

    shutil.copy(weights_from / "model.safetensors", folder / "model.safetensors")
    said = {}
    try:
        parse_args(
            ["--model_name_or_path", str(folder), "--allow_no_fsdp", "true", "--output_dir", str(tmp_path / "run")]
        )
        said["train_fsdp.py"] = None
    except RecipeError as err:
        said["train_fsdp.py"] = str(err)
    found = errors(check_config(REPO / "accelerate_configs" / "zero3.yaml", model=str(folder)))
    said["check_config.py"] = str(found[0]) if found else None
    try:
        model_shape(str(folder))
        said["estimate_memory.py"] = None
    except ValueError as err:
        said["estimate_memory.py"] = str(err)
    # the launch-time check of block_size: never prompts, never fails
    model_positions(str(folder))
    return said


@pytest.mark.parametrize("kind", ["unknown", "known", "tokenizer"])
def test_a_folders_own_code_never_runs_and_is_named(kind, weights, tmp_path):
    folder = folder_with_code(tmp_path, kind)
    said = entry_points(folder, weights, tmp_path)
    # the folder's code did not run, "y" or not
    assert not (tmp_path / f"RAN-{kind}").exists(), said
    # transformers has the class: the folder loads, its auto_map unused
    if kind == "known":
        assert said == {"train_fsdp.py": None, "check_config.py": None, "estimate_memory.py": None}, said
        return
    readers = ["train_fsdp.py"] if kind == "tokenizer" else ["train_fsdp.py", "check_config.py", "estimate_memory.py"]
    for reader in readers:
        assert said[reader] is not None and "this repository runs no code from a model folder" in said[reader], (
            reader,
            said,
        )
        assert ("tokenization_evil.EvilTokenizer" if kind == "tokenizer" else "modeling_evil.EvilForCausalLM") in said[
            reader
        ]
        assert "trust_remote_code: true" in said[reader] and "\n" not in said[reader]


def test_trust_remote_code_lets_the_code_be_named_not_refused(tmp_path):
    from fsdp_recipes.config.model_source import custom_code, remote_code_problem

    folder = folder_with_code(tmp_path, "unknown")
    assert remote_code_problem(str(folder), trust_remote_code=True) is None
    entries, unknown = custom_code(str(folder))
    assert "AutoModelForCausalLM -> modeling_evil.EvilForCausalLM" in entries and "evilmodel" in unknown
    assert not (tmp_path / "RAN-unknown").exists()


def test_every_transformers_load_says_whether_code_may_run_and_weights_are_safetensors():
    """The mechanism: transformers prompts (and on "y" runs a folder's code) only when trust_remote_code is left
    out, and unpickles a .bin unless use_safetensors=True. Every Auto*.from_pretrained / from_config call of the
    package, the tools and train_fsdp.py names trust_remote_code, and every model load use_safetensors=True."""
    files = [
        *sorted((REPO / "fsdp_recipes").rglob("*.py")),
        *sorted((REPO / "tools").glob("*.py")),
        REPO / "train_fsdp.py",
    ]
    missing, calls = [], 0
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("from_pretrained", "from_config")
            ):
                continue
            receiver = node.func.value
            name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
            if not name.startswith("Auto"):
                continue
            calls += 1
            keywords = {k.arg for k in node.keywords}
            # **common carries it (checked below)
            if "trust_remote_code" not in keywords and None not in keywords:
                missing.append(
                    f"{path.relative_to(REPO)}:{node.lineno} {name}.{node.func.attr} without trust_remote_code"
                )
            if (
                name.startswith("AutoModel")
                and node.func.attr == "from_pretrained"
                and not any(
                    k.arg == "use_safetensors" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
            ):
                missing.append(
                    f"{path.relative_to(REPO)}:{node.lineno} {name}.from_pretrained without use_safetensors=True"
                )
    assert calls >= 10 and not missing, missing
    modeling = (REPO / "fsdp_recipes" / "train" / "modeling.py").read_text()
    assert 'common = {"trust_remote_code": args.trust_remote_code' in modeling


INDEX_ENTRIES = [
    "../outside/secret.safetensors",
    "/etc/passwd",
    "sub/model-1.safetensors",
    "..",
    "model-1.bin",
    "a\\b.safetensors",
    "model-9-of-9.safetensors",
    7,
]


@pytest.mark.parametrize("entry", INDEX_ENTRIES, ids=[str(e) for e in INDEX_ENTRIES])
def test_a_shard_index_naming_a_file_outside_the_folder_or_no_shard_is_refused(entry, weights, tmp_path):
    """from_pretrained joins an index's file names to the folder: "../x" or "/etc/passwd" read files elsewhere
    without a word. Refused by train_fsdp.py's check and by the merge's reader (--base-model, a checkpoint)."""
    from fsdp_recipes.ckpt.readers import SafetensorsSource
    from fsdp_recipes.config.model_source import model_source_problem

    folder = tmp_path / "model"
    shutil.copytree(weights, folder)
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    (tmp_path / "outside").mkdir()
    shutil.copy(folder / "model-1.safetensors", tmp_path / "outside" / "secret.safetensors")
    # the files are judged
    weight_map = {"model.embed_tokens.weight": entry, "lm_head.weight": "model-1.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    said = model_source_problem(str(folder), weights=True)
    assert said is not None and ("is not a .safetensors file inside the folder" in said or "lacks" in said), said
    with pytest.raises(CheckpointError):
        SafetensorsSource(folder)


def test_a_sharded_safetensors_folder_is_taken(weights, tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.readers import SafetensorsSource
    from fsdp_recipes.config.model_source import model_source_problem

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(weights, use_safetensors=True).save_pretrained(folder, max_shard_size="200KB")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2
    assert model_source_problem(str(folder), weights=True) is None
    assert len(SafetensorsSource(folder).tensors) > 10


@pytest.mark.parametrize(
    "files", [("pytorch_model.bin",), ("pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin")]
)
def test_weights_only_as_a_pickle_are_refused_before_anything_loads(files, weights, tmp_path):
    """transformers unpickles pytorch_model.bin on every rank (weights_only, yet a pickle, and a hostile one ends in
    a traceback inviting weights_only=False). Refused in one line naming the conversion; nothing is unpickled."""
    from fsdp_recipes.config.model_source import model_source_problem
    from fsdp_recipes.config.parse import parse_args

    folder = tmp_path / "model"
    shutil.copytree(weights, folder)
    (folder / "model.safetensors").unlink()
    # bytes that are no pickle: an attempt to unpickle them would fail loudly, not pass
    for name in files:
        (folder / name).write_bytes(b"not a pickle")
    said = model_source_problem(str(folder), weights=True)
    assert said is not None and "holds its weights only as a pickle" in said and "save_pretrained" in said, said
    with pytest.raises(RecipeError, match="holds its weights only as a pickle"):
        parse_args(
            ["--model_name_or_path", str(folder), "--allow_no_fsdp", "true", "--output_dir", str(tmp_path / "run")]
        )


@pytest.mark.parametrize("where", ["top", "text_config", "deeper"])
@pytest.mark.parametrize(
    "key",
    [
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "n_layers",
        "num_decoder_layers",
        "num_encoder_layers",
        "decoder_layers",
        "encoder_layers",
    ],
)
def test_a_config_of_more_layers_than_any_model_is_one_line_not_a_hang(key, where, tmp_path):
    """Building a 1,000,000-layer config on the meta device to count its parameters took minutes and gigabytes in
    check_config.py and estimate_memory.py, and ran on every rank of a launch."""
    from fsdp_recipes.config.accelerate_config import check_config
    from fsdp_recipes.config.memory import model_shape
    from fsdp_recipes.config.model_source import config_size_problem
    from fsdp_recipes.config.problems import errors

    folder = tmp_path / "deep"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    if where == "top":
        config[key] = 10**6
    elif where == "text_config":
        config["text_config"] = {key: 10**6}
    # a config inside a config inside it
    else:
        config["text_config"] = {"decoder": {key: 10**6}}
    (folder / "config.json").write_text(json.dumps(config))
    assert config_size_problem(str(folder)) is not None and "1000000" in config_size_problem(str(folder))[0]
    with pytest.raises(ValueError, match="more than any model has"):
        model_shape(str(folder))
    found = errors(check_config(REPO / "accelerate_configs" / "zero3.yaml", model=str(folder)))
    assert found and "more than any model has" in found[0].message
    config.pop("text_config", None)
    # a real depth is taken
    config[key] = 32
    (folder / "config.json").write_text(json.dumps(config))
    assert config_size_problem(str(folder)) is None


def test_check_config_names_a_model_that_is_no_model_folder(tmp_path):
    """`--model /etc` was skipped without a word, exit 0."""
    from fsdp_recipes.config.accelerate_config import check_config
    from fsdp_recipes.config.problems import errors

    found = errors(check_config(REPO / "accelerate_configs" / "zero3.yaml", model="/etc"))
    assert found and "is a folder without config.json" in found[0].message, found


@pytest.mark.parametrize("answer", ["found", "missing", "gated", "unreachable"])
@pytest.mark.parametrize("weights", [True, False], ids=["model", "tokenizer"])
def test_a_hub_id_not_in_the_cache_is_asked_of_the_hub_once_before_anything_starts(answer, weights, monkeypatch):
    """With no network, transformers retried for a minute and more on every rank and ended in a traceback each: the
    hub is asked once, up front, and what it says (or why it could not be asked) is one line."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    from fsdp_recipes.config import model_source

    asked = []

    def hub(repo_id, *args, **kwargs):
        asked.append(repo_id)
        # as huggingface_hub raises it for a 401/403 on a gated repository (built without a response)
        if answer == "gated":
            gated = GatedRepoError.__new__(GatedRepoError)
            Exception.__init__(gated, "403 gated")
            raise gated
        if answer == "unreachable":
            raise OSError("[Errno -2] Name or service not known")
        return answer == "found"

    monkeypatch.setattr(huggingface_hub, "file_exists", hub)
    monkeypatch.setattr(huggingface_hub, "repo_exists", hub)
    # its own answers
    monkeypatch.setattr(model_source, "hub_problem", functools.lru_cache(model_source.hub_problem.__wrapped__))
    said = model_source.model_source_problem(f"someone/model-{answer}", weights=weights)
    expected = {
        "found": None,
        "missing": "is not a model on the hub",
        "gated": "is a gated model on the hub",
        "unreachable": "is not in the local hub cache and the hub cannot be reached (OSError: [Errno -2]",
    }[answer]
    assert (said is None) if expected is None else (expected in said and "\n" not in said), said
    assert model_source.model_source_problem(f"someone/model-{answer}", weights=weights) == said and asked == [
        f"someone/model-{answer}"
    ]


def test_trust_remote_code_true_is_said_with_the_files_it_runs(tmp_path, weights, monkeypatch):
    """The opt-in, for code the user has read: no refusal, and a warning naming what will run in every process."""
    import transformers

    from fsdp_recipes.config.accelerate_config import check_config

    # the load itself would import the folder's classes into this test process
    def not_here(*args, **kwargs):
        raise OSError("the test stops here")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", not_here)
    folder = folder_with_code(tmp_path, "known")
    problems = check_config(
        REPO / "accelerate_configs" / "zero3.yaml", model=str(folder), recipe={"trust_remote_code": True}
    )
    warned = [p for p in problems if p.key == "trust_remote_code"]
    assert warned and warned[0].level == "warning" and "modeling_evil.EvilForCausalLM" in warned[0].message, problems
    assert not [p for p in problems if p.level == "error"] and not (tmp_path / "RAN-known").exists(), problems


@pytest.mark.parametrize("answer", ["found", "missing", "unreachable"])
def test_a_hub_dataset_id_is_asked_of_the_hub_once_before_anything_starts(answer, tmp_path, monkeypatch):
    """dataset_name with no network: datasets retried on every rank, then a traceback each. A copy in datasets'
    cache is left to datasets (it loads from there)."""
    import huggingface_hub
    from datasets import config

    from fsdp_recipes.config import model_source
    from fsdp_recipes.config.parse import parse_args

    def hub(repo_id, *args, repo_type=None, **kwargs):
        assert repo_type == "dataset"
        if answer == "unreachable":
            raise OSError("[Errno -2] Name or service not known")
        return answer == "found"

    monkeypatch.setattr(huggingface_hub, "repo_exists", hub)
    monkeypatch.setattr(model_source, "hub_problem", functools.lru_cache(model_source.hub_problem.__wrapped__))
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    argv = [
        "--dataset_name",
        f"someone/data-{answer}",
        "--output_dir",
        str(tmp_path / "run"),
        "--allow_no_fsdp",
        "true",
    ]
    if answer == "found":
        assert parse_args(argv)[1].dataset_name == "someone/data-found"
        return
    expected = "is not a dataset on the hub" if answer == "missing" else "--repo-type dataset) and set HF_HUB_OFFLINE=1"
    with pytest.raises(RecipeError, match=re.escape(expected)):
        parse_args(argv)
    # datasets has a copy: its to load
    (tmp_path / "datasets-cache" / f"someone___data-{answer}").mkdir(parents=True)
    assert parse_args(argv)[1].dataset_name == f"someone/data-{answer}"


@pytest.mark.parametrize(
    "value", ["1000000", 1e6, 32.0, -3, True, [4]], ids=["string", "float", "whole-float", "negative", "bool", "list"]
)
def test_a_layer_count_that_is_no_whole_number_is_one_line(value, tmp_path):
    """A layer count of "1000000", 1e6 or -3 is one line, not a traceback of transformers' config validation in the
    tools and on every rank, nor a model of no layers with negative memory."""
    from fsdp_recipes.config.model_source import config_size_problem

    folder = tmp_path / "odd"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = value
    (folder / "config.json").write_text(json.dumps(config))
    why, fix = config_size_problem(str(folder))
    assert "which is not a number of layers" in why and fix == "give a whole number"


def test_a_tokenizer_class_transformers_lacks_without_code_is_taken(tmp_path):
    """bigscience/bloom ships tokenizer_class BloomTokenizerFast, which transformers
    5.23 lacks as a name and loads as its tokenizers backend with trust_remote_code=False: no code, no refusal.
    With an auto_map naming code for it, it is refused (test_a_folders_own_code_never_runs_and_is_named)."""
    from transformers import AutoTokenizer

    from fsdp_recipes.config.model_source import remote_code_problem

    folder = tmp_path / "bloom-like"
    shutil.copytree(TINY, folder)
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "BloomTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    assert remote_code_problem(str(folder), trust_remote_code=False, tokenizer=True) is None
    # transformers does load it
    assert len(AutoTokenizer.from_pretrained(folder, trust_remote_code=False)) > 100


def test_a_model_type_transformers_lacks_without_code_is_named_as_such(tmp_path):
    from fsdp_recipes.config.model_source import remote_code_problem

    folder = tmp_path / "future"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama9"
    (folder / "config.json").write_text(json.dumps(config))
    # no code to trust: the flag changes nothing
    for trust in (False, True):
        why, fix = remote_code_problem(str(folder), trust_remote_code=trust)
        assert (
            why.startswith("names model_type 'llama9', which transformers")
            and "auto_map" not in why
            and "newer transformers" in fix
        )


@pytest.mark.parametrize(
    "kind", ["lfs_pointer", "link_to_passwd", "empty", "short_header", "header_not_json", "truncated"]
)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_weights_that_are_no_safetensors_file_are_one_line(kind, sharded, weights, tmp_path):
    """A git-lfs pointer (a clone without LFS) or a link to /etc/passwd as model.safetensors is one line: its header
    is read before anything starts, not left to fail on every rank with safetensors' "header too large"."""
    from fsdp_recipes.config.model_source import model_source_problem

    folder = tmp_path / "model"
    shutil.copytree(weights, folder)
    target = folder / "model.safetensors"
    if sharded:
        target = folder / "model-00001-of-00001.safetensors"
        (folder / "model.safetensors").rename(target)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": target.name}})
        )
    whole = target.read_bytes()
    target.unlink()
    # a copy cut short: the header is whole, the tensors are not
    if kind == "truncated":
        target.write_bytes(whole[:-100])
    elif kind == "lfs_pointer":
        target.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 967936\n")
    elif kind == "link_to_passwd":
        target.symlink_to("/etc/passwd")
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "short_header":
        target.write_bytes((1000).to_bytes(8, "little") + b"{}")
    else:
        target.write_bytes((4).to_bytes(8, "little") + b"nope")
    said = model_source_problem(str(folder), weights=True)
    what = "that is truncated" if kind == "truncated" else "that is not a safetensors file"
    assert said is not None and f"has a {target.name} {what}" in said, said
    assert ("git lfs pull" in said) == (kind == "lfs_pointer")


def test_the_tools_ask_the_hub_once_for_a_model_id_not_in_the_cache(monkeypatch):
    """estimate_memory.py and check_config.py ask once and say it in one line (not 26 s of retries, three lines)."""
    import huggingface_hub

    from fsdp_recipes.config import model_source
    from fsdp_recipes.config.accelerate_config import check_config
    from fsdp_recipes.config.memory import model_shape

    monkeypatch.setattr(
        huggingface_hub, "file_exists", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no network"))
    )
    monkeypatch.setattr(model_source, "hub_problem", functools.lru_cache(model_source.hub_problem.__wrapped__))
    with pytest.raises(
        ValueError,
        match=r"someone/model is not in the local hub cache and the hub cannot be reached \(OSError: no network\)",
    ):
        model_shape("someone/model")
    [said] = [
        p for p in check_config(REPO / "accelerate_configs" / "zero3.yaml", model="someone/model") if p.key == "model"
    ]
    assert (
        said.level == "warning"
        and "the hub cannot be reached" in said.message
        and "model checks skipped" in said.message
    )


@pytest.mark.parametrize("name", ["my model", "-bad", "ok/ok--x", "a" * 120])
def test_a_name_that_is_neither_a_folder_nor_a_hub_id_is_one_line(name, tmp_path, monkeypatch):
    """(re-read of the change) the hub probe's cache lookup raised huggingface_hub's validation error from
    parse_args."""
    from fsdp_recipes.config.model_source import model_source_problem

    monkeypatch.chdir(tmp_path)
    for weights in (True, False):
        said = model_source_problem(name, weights=weights)
        assert said.startswith("is neither a local folder nor a hub id (") and "\n" not in said, said


@pytest.mark.parametrize(
    "text, said",
    [
        ("7,000,000,000", "write the parameter count without separators"),
        ("7_000_000_000", "write the parameter count without separators"),
        ("seven billion", "is neither a local path nor a hub id"),
        ("a/../b", "is neither a local path nor a hub id"),
    ],
)
def test_estimate_memory_names_a_model_text_that_is_no_count_path_or_hub_id(text, said):
    """'7,000,000,000' is named as no count, path or hub id, not given huggingface_hub's repo-name rules."""
    from fsdp_recipes.config.memory import model_shape

    with pytest.raises(ValueError, match=re.escape(said)):
        model_shape(text)


def test_a_missing_model_folder_is_the_runs_one_line_not_a_config_warning_first(tmp_path, monkeypatch, capsys):
    """A recipe naming a local model folder that does not exist yet (chat_sft.yaml before the quick start's run):
    the launch check leaves it to the run's own one-line error, with no warning blaming the accelerate config first,
    and a quoted hub message ends at a word."""
    from types import SimpleNamespace

    from fsdp_recipes.config import launcher
    from fsdp_recipes.config.model_source import model_source_problem, not_a_hub_id

    monkeypatch.chdir(tmp_path)
    settings = launcher.from_launch_args(
        ["--config_file", str(REPO / "accelerate_configs" / "zero3.yaml"), "train_fsdp.py"], tmp_path
    )
    monkeypatch.setattr(launcher, "launch_settings", lambda: settings)
    missing = "runs/tiny-llama-pretrain/model"
    raw = SimpleNamespace(
        **dict.fromkeys(launcher.RUN_SETTINGS), model_name_or_path=missing, config_name=None, allow_no_fsdp=False
    )
    assert launcher.check_launch(raw) is settings
    assert "model" not in capsys.readouterr().err
    assert model_source_problem(missing, weights=True).startswith("does not exist (relative paths start where you")
    why, _ = not_a_hub_id(missing)
    assert why.endswith(f"'namespace/repo_name': '{missing}')"), why


@pytest.mark.parametrize(
    "key",
    [
        "model_name_or_path",
        "tokenizer_name",
        "config_name",
        "chat_template_path",
        "chat_template",
        "eos_token",
        "dataset_name",
        "text_column",
        "dataset_split",
    ],
)
@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_an_empty_text_argument_is_named_as_empty(key, value, tmp_path):
    """An empty name is not the folder you launch from ("'' is a folder without config.json"; an empty
    chat_template_path loaded the template of whatever tokenizer lay there), nor a dataset or a token."""
    from fsdp_recipes.config.parse import parse_args

    argv = [f"--{key}={value}", "--output_dir", str(tmp_path / "out"), "--allow_no_fsdp", "true"]
    if key not in ("model_name_or_path", "config_name"):
        argv += ["--config_name", str(REPO / "assets" / "tiny-llama")]
    with pytest.raises(RecipeError) as err:
        parse_args(argv)
    assert f"{key}={value!r} is empty" in str(err.value), str(err.value)
