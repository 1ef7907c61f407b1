"""--push_to_hub, as a user coming from the stock Trainer or TRL types it: the final model folder (and a LoRA run's
adapter, under adapter/) reaches the hub in one commit once the run has finished; what can stop the upload is one
line before anything loads; hub options that would be ignored are refused; a failed upload leaves the model saved
and says how to finish by hand. The hub is tests/helpers/fake_hub.py, served to the real huggingface_hub client."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import REPO, launch, quick
from helpers.fake_hub import serve

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError

NO_FSDP = ("--allow_no_fsdp", "true")
# Each hub option of TrainingArguments with a value that is not its default (written out here, not read from
# fsdp_recipes.config.hub_push): without --push_to_hub true the stock Trainer ignores them without a word
STRAY = {
    "hub_model_id": "me/model",
    "hub_token": "hf_abc",
    "hub_private_repo": "true",
    "hub_revision": "v1",
    "hub_strategy": "end",
    "hub_always_push": "true",
}


def with_role(role: str):
    """A fixture: the fake hub as this process's huggingface_hub sees it (its endpoint, HF_TOKEN its token of
    ``role``; no telemetry request, which would be one more request to count)."""

    @pytest.fixture
    def fixture(tmp_path, monkeypatch):
        with serve(tmp_path / "hub", role=role) as server:
            monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
            monkeypatch.setenv("HF_TOKEN", server.token)
            monkeypatch.setenv("NO_PROXY", "127.0.0.1")
            monkeypatch.delenv("LOCAL_RANK", raising=False)
            yield server

    return fixture


hub = with_role("write")
read_hub = with_role("read")
fine_grained_hub = with_role("fineGrained")


def plan_of(tmp_path, *flags):
    return parse_args([*flags, "--output_dir", str(tmp_path / "out"), *NO_FSDP])[2]


def refused(tmp_path, *flags) -> str:
    with pytest.raises(RecipeError) as err:
        plan_of(tmp_path, *flags)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("option", sorted(STRAY))
def test_a_hub_option_without_push_to_hub_is_said_not_ignored(tmp_path, hub, capsys, option):
    """TRL and handbook recipes keep their hub keys with push_to_hub false: the run goes on, and says nothing is
    uploaded (the stock Trainer ignores them without a word)."""
    assert plan_of(tmp_path, f"--{option}", STRAY[option]).push is None
    said = capsys.readouterr().err
    assert f"warning: {option} is set, and push_to_hub is false: nothing is uploaded" in said
    assert hub.requests == []


def test_several_stray_options_are_named_together_and_a_recipe_counts_as_given(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"config_name: {REPO}/assets/tiny-llama\ntrain_file: {REPO}/assets/data/tiny_corpus.txt\n"
        "hub_model_id: me/model\nhub_private_repo: true\n"
    )
    plan_of(tmp_path, str(recipe))
    assert "hub_model_id, hub_private_repo are set, and push_to_hub is false" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_uploads_of_checkpoints_to_resume_from_are_refused_before_the_hub_is_asked(tmp_path, hub, strategy):
    message = refused(tmp_path, "--push_to_hub", "true", "--hub_strategy", strategy)
    assert f"hub_strategy {strategy} uploads checkpoints to resume from" in message
    assert hub.requests == []


@pytest.mark.parametrize("flags", [("--hub_strategy", "every_save"), ("--hub_always_push", "true")])
def test_per_save_pushes_are_said_to_be_one_upload_at_the_end(tmp_path, hub, capsys, flags):
    """The alignment-handbook's recipes say hub_strategy: every_save: the run goes on, uploading once, and says so."""
    assert (
        plan_of(tmp_path, "--push_to_hub", "true", "--hub_model_id", "tester/tiny", *flags).push.repo_id
        == "tester/tiny"
    )
    assert "asks for uploads at every save" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, repo_id",
    [
        # the stock Trainer's rule: output_dir's name
        ((), "out"),
        (("--hub_model_id", "tester/tiny"), "tester/tiny"),
        (("--hub_model_id", "test-org/tiny", "--hub_strategy", "end"), "test-org/tiny"),
        (("--hub_model_id", "tiny", "--hub_private_repo", "true", "--hub_revision", "run-1"), "tiny"),
    ],
)
def test_a_push_the_hub_will_take_is_planned_and_the_trainer_does_not_push(tmp_path, hub, flags, repo_id):
    model_args, _, plan = parse_args(["--push_to_hub", "true", *flags, "--output_dir", str(tmp_path / "out"), *NO_FSDP])
    assert plan.push.repo_id == repo_id and plan.raw.push_to_hub is False
    assert plan.push.private == ("--hub_private_repo" in flags or None)
    # is it there, and public?
    private_asks = ["/api/models/tester/tiny"] if "--hub_private_repo" in flags else []
    assert [path for _, path in hub.requests] == ["/api/whoami-v2", *private_asks]


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# (what the user's setup is, how to make it, words the line must hold)
ACCESS = {
    "offline": (lambda mp, hub: mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True), "HF_HUB_OFFLINE is set"),
    "no token": (
        lambda mp, hub: (
            mp.delenv("HF_TOKEN"),
            mp.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", "/nonexistent/token"),
            mp.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", "/nonexistent/stored"),
        ),
        "no hub token",
    ),
    "wrong token": (lambda mp, hub: mp.setenv("HF_TOKEN", "hf_not_the_one"), "refuses the token (401"),
    "no hub there": (
        lambda mp, hub: mp.setattr(huggingface_hub.constants, "ENDPOINT", closed_port()),
        "the hub cannot be reached",
    ),
}


@pytest.mark.parametrize("case", sorted(ACCESS))
def test_what_stops_the_upload_is_one_line_before_anything_loads(tmp_path, hub, monkeypatch, case):
    make, words = ACCESS[case]
    make(monkeypatch, hub)
    message = refused(tmp_path, "--push_to_hub", "true", "--hub_model_id", "tester/tiny")
    assert words in message, message
    # the way round: train, upload after
    assert f"hf upload tester/tiny {tmp_path / 'out' / 'model'}" in message


def test_a_namespace_the_token_cannot_write_to_is_refused_naming_one_it_can(tmp_path, hub):
    message = refused(tmp_path, "--push_to_hub", "true", "--hub_model_id", "someone-else/tiny")
    assert "cannot write to 'someone-else'" in message and "--hub_model_id tester/tiny" in message


def test_a_read_only_token_is_refused(tmp_path, read_hub):
    assert "is read-only" in refused(tmp_path, "--push_to_hub", "true", "--hub_model_id", "tester/tiny")


def test_a_fine_grained_token_is_not_judged_by_its_namespace(tmp_path, fine_grained_hub):
    assert (
        plan_of(tmp_path, "--push_to_hub", "true", "--hub_model_id", "someone-else/tiny").push.repo_id
        == "someone-else/tiny"
    )


def test_only_each_nodes_local_rank_0_asks_the_hub(tmp_path, hub, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert plan_of(tmp_path, "--push_to_hub", "true", "--hub_model_id", "tester/tiny").push is not None
    assert hub.requests == []


def test_the_way_round_at_parse_time_keeps_the_branch_privacy_and_adapter(tmp_path, hub, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = refused(
        tmp_path,
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "tester/tiny",
        "--hub_private_repo",
        "true",
        "--hub_revision",
        "run-1",
        "--use_peft",
        "true",
    )
    out = tmp_path / "out"
    assert (
        f"hf upload tester/tiny {out / 'model'} --revision run-1 --private; "
        f"hf upload tester/tiny {out / 'adapter'} adapter --revision run-1 --private"
    ) in message


def test_an_empty_hub_model_id_is_refused_not_replaced_by_output_dir(tmp_path, hub):
    assert "hub_model_id is empty" in refused(tmp_path, "--push_to_hub", "true", "--hub_model_id", " ")


# Branch names, judged against git's own rules for a branch's ref name (git check-ref-format refs/heads/<name>)
BRANCHES = [
    "run-1",
    "dev",
    "feature/x",
    "v1.0",
    "a_b",
    "UPPER",
    "bad..name",
    "a b",
    "-lead",
    ".hidden",
    "end.",
    "x.lock",
    "a//b",
    "a/.b",
    "a.lock/b",
    "tilde~1",
    "caret^",
    "colon:x",
    "q?",
    "star*",
    "[bracket",
    "back\\slash",
    "at@{x",
    "@",
    "tab\tx",
    "trailing/",
]


@pytest.mark.parametrize("branch", BRANCHES)
def test_a_branch_name_git_refuses_is_refused_before_training(tmp_path, hub, branch):
    import subprocess

    git_takes = subprocess.run(["git", "check-ref-format", f"refs/heads/{branch}"], capture_output=True).returncode == 0
    # = : '-lead' is no flag
    flags = ("--push_to_hub", "true", "--hub_model_id", "tester/tiny", f"--hub_revision={branch}")
    if git_takes:
        assert plan_of(tmp_path, *flags).push.revision == branch
    else:
        assert "is not a valid branch name" in refused(tmp_path, *flags)


def test_a_pull_request_ref_is_refused(tmp_path, hub):
    assert "pull request" in refused(
        tmp_path, "--push_to_hub", "true", "--hub_model_id", "tester/tiny", "--hub_revision", "refs/pr/1"
    )


@pytest.mark.parametrize("exists", [None, "public", "private"])
def test_hub_private_repo_true_into_a_public_repository_is_refused(tmp_path, hub, exists):
    """create_repo(exist_ok=True) leaves an existing repository as it is: the upload would have been public."""
    from huggingface_hub import HfApi

    if exists:
        HfApi(token=hub.token).create_repo("tester/tiny", private=exists == "private")
    flags = ("--push_to_hub", "true", "--hub_model_id", "tester/tiny", "--hub_private_repo", "true")
    if exists == "public":
        assert "exists and is public" in refused(tmp_path, *flags)
    else:
        assert plan_of(tmp_path, *flags).push.private is True


# A fine-grained token's scoped rights, as whoami gives them: (entity type, entity name, permissions)
SCOPES = {
    "the user's namespace": (
        [("user", "tester", ["repo.content.read", "repo.write"])],
        {"tester/tiny": True, "test-org/tiny": False},
    ),
    "an org": ([("org", "test-org", ["repo.write"])], {"tester/tiny": False, "test-org/tiny": True}),
    "one repository": ([("model", "tester/tiny", ["repo.write"])], {"tester/tiny": True, "tester/other": False}),
    "read only": ([("user", "tester", ["repo.content.read"])], {"tester/tiny": False}),
}


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_a_fine_grained_token_is_judged_by_its_scoped_rights(tmp_path, monkeypatch, scope):
    entries, verdicts = SCOPES[scope]
    scoped = [{"entity": {"type": t, "name": n}, "permissions": perms} for t, n, perms in entries]
    with serve(tmp_path / "hub", role="fineGrained", scoped=scoped) as server:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
        monkeypatch.setenv("HF_TOKEN", server.token)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        for repo, may in verdicts.items():
            flags = ("--push_to_hub", "true", "--hub_model_id", repo)
            if may:
                assert plan_of(tmp_path, *flags).push.repo_id == repo
            else:
                assert "cannot write to" in refused(tmp_path, *flags)


def test_the_token_is_not_in_the_plans_repr(tmp_path, hub):
    push = plan_of(tmp_path, "--push_to_hub", "true", "--hub_model_id", "tester/tiny", "--hub_token", hub.token).push
    assert push.token == hub.token and hub.token not in repr(push)


def a_run_folder(root: Path, adapter: bool) -> Path:
    """output_dir as a finished run leaves it: model/ (a tiny Llama that loads) and, for LoRA, adapter/."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = root / "run"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")).save_pretrained(
        out / "model"
    )
    AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama").save_pretrained(out / "model")
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "__0_0.distcp").write_bytes(b"sharded")
    (out / "run_args.json").write_text("{}")
    if adapter:
        (out / "adapter").mkdir()
        (out / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("adapter", [False, True], ids=["model", "lora"])
def test_the_upload_is_the_model_folder_at_the_top_and_the_adapter_beside_in_one_commit(tmp_path, hub, adapter):
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    out = a_run_folder(tmp_path, adapter)
    url = upload_final_model(HubPush("tester/tiny", private=True), str(out), step=2, log=lambda line: None)
    stored = files_of(hub.repo_folder("tester/tiny"))
    expected = files_of(out / "model") | (
        {f"adapter/{k}": v for k, v in files_of(out / "adapter").items()} if adapter else {}
    )
    # no checkpoint, no run record
    assert stored == expected
    assert url and [path for _, path in hub.requests].count("/api/models/tester/tiny/commit/main") == 1
    assert hub.repos["tester/tiny"]["private"] is True
    AutoModelForCausalLM.from_pretrained(hub.repo_folder("tester/tiny"))


def test_an_upload_to_a_branch_lands_there(tmp_path, hub):
    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    out = a_run_folder(tmp_path, adapter=False)
    upload_final_model(HubPush("tester/tiny", revision="run-1"), str(out), step=None, log=lambda line: None)
    assert files_of(hub.repo_folder("tester/tiny", "run-1")) == files_of(out / "model")


@pytest.mark.parametrize("private, revision", [(None, None), (True, "run-1")])
@pytest.mark.parametrize("case", ["the hub refuses the repository", "the hub is gone"])
def test_a_failed_upload_keeps_the_model_and_says_how_to_finish(
    tmp_path, fine_grained_hub, monkeypatch, case, private, revision
):
    """The commands it gives do what the push would have: the same branch, and private (a repository the first
    `hf upload` creates is public unless told)."""
    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    out = a_run_folder(tmp_path, adapter=True)
    before = files_of(out)
    repo = "someone-else/tiny" if case == "the hub refuses the repository" else "tester/tiny"
    if case == "the hub is gone":
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", closed_port())
    with pytest.raises(RecipeError) as err:
        upload_final_model(HubPush(repo, private=private, revision=revision), str(out), step=2, log=lambda line: None)
    message = str(err.value)
    assert "\n" not in message and "the model is saved" in message
    options = (f" --revision {revision}" if revision else "") + (" --private" if private else "")
    assert f"hf upload {repo} {out / 'model'}{options}; hf upload {repo} {out / 'adapter'} adapter{options}`" in message
    assert files_of(out) == before


# save_pretrained's max_shard_size (0.97 MB model)
LAYOUTS = {"single file": None, "2 shards": "600KB", "4 shards": "300KB"}


def tiny_model(seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))


def save(model, folder: Path, layout: str) -> None:
    model.save_pretrained(folder, **({"max_shard_size": LAYOUTS[layout]} if LAYOUTS[layout] else {}))
    assert (folder / "model.safetensors").is_file() == (LAYOUTS[layout] is None)


def same_weights(folder: Path, model) -> bool:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    return all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "old, new",
    [
        (None, "single file"),
        ("single file", "2 shards"),
        ("2 shards", "single file"),
        ("4 shards", "2 shards"),
        ("single file", "single file"),
    ],
)
def test_an_upload_over_a_model_already_in_the_repository_loads_as_this_model_or_is_refused(tmp_path, hub, old, new):
    """A repository that already holds a model (an earlier run, another layout): either from_pretrained of the
    repository after our commit gives this run's weights, or, where a file left there would be loaded instead (a
    single model.safetensors beside our shards: transformers takes it first), the upload is refused, and that
    refusal is checked to be needed: the files as they would have been load the old weights."""
    import shutil

    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    out, repo = tmp_path / "run", hub.repo_folder("tester/tiny")
    save(trained := tiny_model(0), out / "model", new)
    if old is not None:
        save(tiny_model(1), repo, old)
    before = files_of(repo) if repo.is_dir() else {}
    try:
        upload_final_model(HubPush("tester/tiny"), str(out), step=2, log=lambda line: None)
    except RecipeError as err:
        assert "the model is saved, but not uploaded" in str(err) and "model.safetensors" in str(err)
        # nothing committed
        assert files_of(repo) == before
        would_be = tmp_path / "would-be"
        shutil.copytree(repo, would_be)
        shutil.copytree(out / "model", would_be, dirs_exist_ok=True)
        # the refusal was needed
        assert not same_weights(would_be, trained)
        return
    assert same_weights(repo, trained)


def same_outputs(folder: Path, model) -> bool:
    """What from_pretrained of ``folder`` computes (an adapter's config beside the model is applied by transformers)
    against ``model`` on one input."""
    from transformers import AutoModelForCausalLM

    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        return torch.allclose(AutoModelForCausalLM.from_pretrained(folder)(ids).logits, model(ids).logits)


def peft_adapter(folder: Path) -> None:
    """An adapter as peft saves it (TRL's push of a LoRA run puts these files at the repository's top)."""
    from peft import LoraConfig, get_peft_model

    get_peft_model(tiny_model(1), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
        folder
    )


@pytest.mark.parametrize("ours_has_adapter", [False, True], ids=["model", "model+adapter"])
@pytest.mark.parametrize("left", ["an adapter at the top", "an adapter under adapter/"])
def test_an_earlier_adapter_in_the_repository_is_never_left_beside_this_model(tmp_path, hub, left, ours_has_adapter):
    """An adapter at the repository's top is applied by from_pretrained over the model it loads (checked: the files as
    they would have been compute other logits); one under adapter/ that this upload does not replace would be another
    run's adapter beside this model. Either is refused, naming the files; nothing committed."""
    import shutil

    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    out, repo = a_run_folder(tmp_path, adapter=ours_has_adapter), hub.repo_folder("tester/tiny")
    save(tiny_model(2), repo, "single file")
    peft_adapter(repo if left == "an adapter at the top" else repo / "adapter")
    before = files_of(repo)
    # ours replaces adapter_config.json and its weights
    if left == "an adapter under adapter/" and ours_has_adapter:
        # peft's model card: a file ours does not replace
        (repo / "adapter" / "README.md").unlink()
        before = files_of(repo)
        upload_final_model(HubPush("tester/tiny"), str(out), step=2, log=lambda line: None)
        assert (
            files_of(repo)["adapter/adapter_model.safetensors"]
            == (out / "adapter" / "adapter_model.safetensors").read_bytes()
        )
        return
    with pytest.raises(RecipeError) as err:
        upload_final_model(HubPush("tester/tiny"), str(out), step=2, log=lambda line: None)
    assert "adapter_config.json" in str(err.value) and "the model is saved, but not uploaded" in str(err.value)
    assert files_of(repo) == before
    if left == "an adapter at the top":
        would_be = tmp_path / "would-be"
        shutil.copytree(repo, would_be)
        shutil.copytree(out / "model", would_be, dirs_exist_ok=True)
        from transformers import AutoModelForCausalLM

        assert same_outputs(out / "model", AutoModelForCausalLM.from_pretrained(out / "model"))
        # the refusal was needed
        assert not same_outputs(would_be, AutoModelForCausalLM.from_pretrained(out / "model"))


def test_the_record_of_a_lora_base_s_local_path_stays_local(tmp_path, hub):
    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    out = a_run_folder(tmp_path, adapter=True)
    (out / "adapter" / "base_identity.json").write_text('{"path": "/home/someone/private/base"}')
    upload_final_model(HubPush("tester/tiny"), str(out), step=2, log=lambda line: None)
    assert "adapter/adapter_config.json" in files_of(hub.repo_folder("tester/tiny"))
    assert "adapter/base_identity.json" not in files_of(hub.repo_folder("tester/tiny"))


@pytest.mark.slow
def test_a_lora_run_with_push_to_hub_uploads_its_model_and_adapter_once_it_has_finished(tmp_path, trained):
    """The whole path, launched: parse's check (whoami), the Trainer kept from pushing output_dir at each save, one
    commit at the end holding exactly model/ and adapter/, loadable from the repository; no token in run_args.json."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = trained("accelerate_configs/zero3.yaml").model_dir
    out = tmp_path / "run"
    lora = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "1e-2"]
    with serve(tmp_path / "hub") as hub:
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": hub.token,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0",
            "NO_PROXY": "127.0.0.1",
            "HF_HOME": str(tmp_path / "hf_home"),
        }
        proc = launch(
            "accelerate_configs/zero3.yaml",
            *quick(max_steps="4", save_steps="2"),
            *lora,
            "--model_name_or_path",
            str(base),
            "--output_dir",
            str(out),
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "tester/tiny-lora",
            env=env,
        )
    repo = hub.repo_folder("tester/tiny-lora")
    assert "uploaded to the hub" in proc.stdout
    # a local record
    adapter = {f"adapter/{k}": v for k, v in files_of(out / "adapter").items() if k != "base_identity.json"}
    uploaded = files_of(repo)
    # the base is a local folder: the uploaded adapter config names none (that path means nothing off this machine)
    config = json.loads(adapter.pop("adapter/adapter_config.json"))
    assert config["base_model_name_or_path"] == str(base)
    assert json.loads(uploaded.pop("adapter/adapter_config.json")) == {**config, "base_model_name_or_path": None}
    assert uploaded == files_of(out / "model") | adapter
    # none per save
    assert [path for _, path in hub.requests].count("/api/models/tester/tiny-lora/commit/main") == 1
    # the Trainer's push wrote none
    assert not (out / "training_args.bin").exists() and not (out / "tokenizer.json").exists()
    record = (out / "run_args.json").read_text()
    assert hub.token not in record
    assert json.loads(record)["push_to_hub"] == {"repo_id": "tester/tiny-lora", "private": None, "revision": None}
    merged = AutoModelForCausalLM.from_pretrained(repo).state_dict()
    by_peft = (
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), repo, subfolder="adapter")
        .merge_and_unload()
        .state_dict()
    )
    assert merged.keys() == by_peft.keys() and all(torch.allclose(merged[k], by_peft[k]) for k in merged)


# base_model_name_or_path as peft records it from what the run loaded: (value, uploaded as)
BASES = {
    "an absolute folder": ("{tmp}/bases/llama", None),
    "a folder under home": ("~/models/llama-base", None),
    "a relative folder": ("./bases/llama", None),
    "a parent's folder": ("../llama", None),
    "a nested relative folder": ("runs/sft/model", None),
    "an existing relative folder": ("bases", None),
    "a Windows path": ("C:\\models\\llama", None),
    "a hub id": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B"),
    "a hub id without namespace": ("gpt2", "gpt2"),
    "none recorded": (None, None),
}


@pytest.mark.parametrize("case", sorted(BASES))
def test_the_uploaded_adapter_config_names_no_local_path(tmp_path, hub, monkeypatch, case):
    """peft writes the folder the base was loaded from into adapter_config.json: on the hub that path means nothing
    and shows the user's folders, so it goes up as null; a hub id goes up as it is. The local file is unchanged (a
    merge here reads it)."""
    from fsdp_recipes.config.hub_push import HubPush
    from fsdp_recipes.train.upload import upload_final_model

    value, uploaded = BASES[case]
    value = value if value is None else value.replace("{tmp}", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bases" / "llama").mkdir(parents=True)
    out = a_run_folder(tmp_path, adapter=True)
    config = {"peft_type": "LORA", "r": 8, "base_model_name_or_path": value, "target_modules": ["q_proj"]}
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    before = files_of(out)
    said = []
    upload_final_model(HubPush("tester/tiny"), str(out), step=2, log=said.append)
    stored = json.loads((hub.repo_folder("tester/tiny") / "adapter" / "adapter_config.json").read_text())
    assert stored == {**config, "base_model_name_or_path": uploaded}
    assert files_of(out) == before
    assert any("names its base by a local path" in line for line in said) == (value is not None and uploaded is None)
