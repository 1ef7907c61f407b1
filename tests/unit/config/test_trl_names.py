"""TRL's names: recipes written for TRL's sft.py (alignment-handbook style, tests/fixtures/trl/) run here where
their keys mean the same thing, and the keys that do not are named, all of them in one line; an alias and our
name giving different values is an error naming both; TRL settings with no equivalent for the data are refused."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, launch, logged_losses

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.data import IGNORE_INDEX, build_datasets

FIXTURES = REPO / "tests" / "fixtures" / "trl"
NO_FSDP = ("--allow_no_fsdp", "true")
TINY = f"config_name: {REPO}/assets/tiny-llama\n"
CORPUS = f"train_file: {REPO}/assets/data/tiny_corpus.txt\n"
CHAT = f"train_file: {REPO}/assets/data/tiny_chat.jsonl\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where the fixtures' relative paths point: a tiny pre-trained model (random weights) and a chat dataset folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("trl")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama"))
    model.save_pretrained(root / "tiny-model")
    AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama").save_pretrained(root / "tiny-model")
    (root / "data").mkdir()
    shutil.copy(REPO / "assets" / "data" / "tiny_chat.jsonl", root / "data" / "train.jsonl")
    return root


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_handbook_recipe_reads_as_our_settings(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    model_args, data_args, plan = parse_args([str(FIXTURES / "sft_tiny_chat.yaml"), *NO_FSDP])
    assert (data_args.block_size, data_args.dataset_split, data_args.preprocessing_num_workers) == (64, "train", 1)
    # TRL's packing false on chat data: one conversation per row, padded
    assert data_args.packing == "concat"
    assert (
        model_args.dtype == "float32" and model_args.use_peft and model_args.lora_target_modules == ["q_proj", "v_proj"]
    )
    assert plan.raw.max_steps == 4 and plan.raw.learning_rate == 1e-2
    from transformers import AutoTokenizer

    dataset, _, _ = build_datasets(data_args, AutoTokenizer.from_pretrained("tiny-model"))
    labels = dataset[0]["labels"]
    # assistant-only
    assert len(dataset[0]["input_ids"]) <= 64 and IGNORE_INDEX in labels and set(labels) != {IGNORE_INDEX}


def test_keys_without_a_meaning_here_are_named_in_one_line(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    with pytest.raises(RecipeError) as err:
        parse_args([str(FIXTURES / "sft_handbook_extras.yaml"), *NO_FSDP])
    message = str(err.value)
    assert "\n" not in message
    trl, _, unknown = message.partition("unknown key(s)")
    assert "eval_packing (evaluation data is prepared as the training data is" in trl, message
    assert "loss_type (the loss is the model's token-level cross-entropy (TRL's nll))" in trl, message
    assert "wamrup_steps (did you mean warmup_steps?)" in unknown, message
    taken = ("max_seq_length", "dataset_num_proc", "packing", "torch_dtype", "chat_template", "dataset_mixture")
    for meaningful in (*taken, "model_revision", "warmup_ratio"):
        assert not re.search(rf"\b{meaningful}\b", message), (meaningful, message)


def test_dataset_text_field_is_text_column(tmp_path):
    _, data_args, _ = parse_args(
        [write(tmp_path, TINY + CORPUS), "--dataset_text_field", "text", "--max_seq_length", "32", *NO_FSDP]
    )
    assert (data_args.text_column, data_args.block_size) == ("text", 32)
    with pytest.raises(RecipeError, match="record 1 has no 'body' field"):
        _, data_args, _ = parse_args(
            [
                write(tmp_path, TINY + f"train_file: {REPO}/assets/data/tiny_chat.jsonl\ndata_format: text\n"),
                "--dataset_text_field",
                "body",
                *NO_FSDP,
            ]
        )


@pytest.mark.parametrize(
    "text, argv, named",
    [
        (TINY + CORPUS + "max_length: 64\nblock_size: 128\n", [], ("block_size", "max_length")),
        (TINY + CORPUS + "max_length: 64\nmax_seq_length: 32\n", [], ("max_length", "max_seq_length")),
        (TINY + CORPUS, ["--max_length", "64", "--block_size=128"], ("--max_length", "--block_size")),
        (
            TINY + CORPUS,
            ["--dataset_text_field", "body", "--text_column", "text"],
            ("--dataset_text_field", "--text_column"),
        ),
    ],
)
def test_alias_and_our_name_with_different_values_is_an_error_naming_both(tmp_path, text, argv, named):
    with pytest.raises(RecipeError) as err:
        parse_args([write(tmp_path, text), *argv, *NO_FSDP])
    assert all(name in str(err.value) for name in named), str(err.value)


def test_trl_flags_without_an_equivalent_are_named_with_the_other_unknown_flags(tmp_path):
    with pytest.raises(RecipeError) as err:
        parse_args(
            [
                write(tmp_path, TINY + CORPUS),
                "--padding_free",
                "true",
                "--eval_packing=false",
                "--learnig_rate",
                "1",
                *NO_FSDP,
            ]
        )
    assert str(err.value).startswith(
        "flags: TRL flag(s) with no equivalent here: padding_free (padding-free batches come with packing here: "
        "set packing: padding_free), eval_packing (evaluation data is prepared as the training data is (TRL's "
        "eval_packing unset)); unknown flag(s): learnig_rate (did you mean learning_rate?)"
    ), str(err.value)


def test_alias_and_our_name_agreeing_is_fine(tmp_path):
    _, data_args, _ = parse_args(
        [write(tmp_path, TINY + CORPUS + "max_length: 64\nblock_size: 64\n"), "--max_seq_length", "48", *NO_FSDP]
    )
    # a flag overrides the recipe, whichever spelling
    assert data_args.block_size == 48


@pytest.mark.parametrize(
    "text, packing",
    [
        (CORPUS + "packing: true\npacking_strategy: wrapped\n", "concat"),
        (CORPUS + "packing: true\npacking_strategy: bfd_split\n", "padding_free"),
        (CORPUS + "packing: false\n", "concat"),
        (CORPUS + "packing: true\n", "padding_free"),
        (CORPUS, "concat"),
        (CHAT + "packing: true\n", "padding_free"),
        (CHAT + "packing: false\nassistant_only_loss: true\n", "concat"),
        (CORPUS + "packing: padding_free\nassistant_only_loss: false\ncompletion_only_loss: false\n", "padding_free"),
    ],
)
def test_trl_packing_becomes_our_mode(tmp_path, text, packing):
    _, data_args, _ = parse_args([write(tmp_path, TINY + text + "block_size: 64\n"), *NO_FSDP])
    assert data_args.packing == packing
    from transformers import AutoTokenizer

    # the data-format checks pass
    build_datasets(data_args, AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama"))


@pytest.mark.parametrize(
    "text, message",
    [
        (CORPUS + "assistant_only_loss: true\n", "assistant_only_loss=true needs chat data"),
        (CORPUS + "completion_only_loss: true\n", "completion_only_loss=true is for TRL's prompt-completion datasets"),
        (CORPUS + "packing: concat\npacking_strategy: bfd\n", "packing_strategy=bfd is TRL's choice for packing: true"),
        (CORPUS + "max_length: null\n", "TRL's no-truncation has no equivalent here"),
        (
            CHAT + "packing: true\npacking_strategy: wrapped\n",
            "packing_strategy wrapped joins conversations into fixed blocks",
        ),
    ],
)
def test_trl_settings_without_an_equivalent_are_refused(tmp_path, text, message):
    from transformers import AutoTokenizer

    with pytest.raises(RecipeError, match=re.escape(message)):
        _, data_args, _ = parse_args([write(tmp_path, TINY + text), *NO_FSDP])
        # the format is known here
        build_datasets(data_args, AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama"))


def data_files(root: Path) -> dict[str, Path]:
    """The same corpus as each local format a run reads, and the chat data as JSON lines."""
    import csv
    import json

    lines = [line for line in (REPO / "assets" / "data" / "tiny_corpus.txt").read_text().splitlines() if line.strip()][
        :40
    ]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    with open(root / "corpus.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text"], *([line] for line in lines)])
    (root / "corpus.json").write_text(json.dumps([{"text": line} for line in lines]))
    chat = [
        json.loads(line)
        for line in (REPO / "assets" / "data" / "tiny_chat.jsonl").read_text().splitlines()
        if line.strip()
    ]
    (root / "chat.json").write_text(json.dumps(chat))
    return {
        "txt": REPO / "assets" / "data" / "tiny_corpus.txt",
        "csv": root / "corpus.csv",
        "jsonl text": root / "corpus.jsonl",
        "jsonl chat": REPO / "assets" / "data" / "tiny_chat.jsonl",
        "json text": root / "corpus.json",
        "json chat": root / "chat.json",
    }


TRL_SETTINGS = [
    "packing: false\n",
    "packing: true\n",
    "packing: true\npacking_strategy: wrapped\n",
    "packing: true\npacking_strategy: bfd_split\n",
    "assistant_only_loss: true\n",
    "assistant_only_loss: false\n",
]


@pytest.mark.parametrize("setting", TRL_SETTINGS)
@pytest.mark.parametrize("kind", ["txt", "csv", "jsonl text", "jsonl chat", "json text", "json chat"])
def test_a_trl_setting_the_data_cannot_take_is_refused_at_parse_time_as_loading_the_data_would(
    tmp_path, monkeypatch, kind, setting
):
    """What loading the data decides (train/data.py, from its columns) is decided before the launch for a local
    file, with the same line, not after every rank has started and loaded the data."""
    from transformers import AutoTokenizer

    import fsdp_recipes.config.arguments as arguments

    recipe = write(tmp_path, TINY + f"train_file: {data_files(tmp_path)[kind]}\nblock_size: 64\n" + setting)
    with monkeypatch.context() as later:
        # the format known only once loaded
        later.setattr(arguments, "sniff_format", lambda path, args: None)
        _, data_args, _ = parse_args([recipe, *NO_FSDP])
        try:
            build_datasets(data_args, AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama"))
            at_load = None
        except RecipeError as err:
            at_load = str(err)
    if at_load is None:
        parse_args([recipe, *NO_FSDP])
    else:
        with pytest.raises(RecipeError) as err:
            parse_args([recipe, *NO_FSDP])
        assert at_load in str(err.value)


def test_trl_packing_flag_on_the_command_line(tmp_path):
    _, data_args, _ = parse_args([write(tmp_path, TINY + CHAT), "--packing", "true", *NO_FSDP])
    assert data_args.packing == "padding_free"


def help_text(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_help_is_grouped_with_aliases_and_the_rest_behind_help_all(capsys, monkeypatch):
    # argparse wraps to the terminal: CI's differs from a developer's
    monkeypatch.setenv("COLUMNS", "100")
    short, full = help_text(["--help"], capsys), help_text(["--help-all"], capsys)
    titles = [line[:-1] for line in short.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles[1:] == [
        "model",
        "LoRA and QLoRA (TRL's ModelConfig names)",
        "data (TRL's SFTConfig names are accepted where they mean the same)",
        "run",
        "training (the most used transformers TrainingArguments)",
    ], titles
    assert "--block_size BLOCK_SIZE, --max_length BLOCK_SIZE, --max_seq_length BLOCK_SIZE" in short
    assert "--text_column TEXT_COLUMN, --dataset_text_field TEXT_COLUMN" in short
    # each option once
    assert "--output-dir" not in short and "--output-dir" not in full
    assert (
        "--fsdp_config" not in short and "--fsdp_config" in full and "--help-all lists them" in " ".join(short.split())
    )
    assert len(short.splitlines()) < 280 and 2 * len(short.splitlines()) < len(full.splitlines())


def test_help_under_a_launcher_is_printed_by_local_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert help_text(["--help"], capsys) == "" and capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "--block_size" in help_text(["--help"], capsys)


@pytest.mark.slow
def test_handbook_recipe_trains_unchanged(workdir):
    proc = launch("accelerate_configs/zero3.yaml", str(FIXTURES / "sft_tiny_chat.yaml"), cwd=workdir)
    out = workdir / "runs" / "tiny-chat-sft"
    assert (out / "model" / "model.safetensors").is_file() and (out / "adapter").is_dir(), proc.stderr[-2000:]
    assert len(logged_losses(out)) == 2


@pytest.mark.slow
def test_help_under_accelerate_launch_is_printed_once():
    proc = launch("accelerate_configs/zero3.yaml", "--help")
    assert proc.stdout.count("usage:") == 1 and "usage:" not in proc.stderr, proc.stderr[-2000:]


def _two_values(action) -> tuple[str, str] | None:
    """Two different values argparse accepts for ``action`` (None: a flag without a single value)."""
    # flags.declare's one-line refusals wrap it
    convert = getattr(action.type, "__wrapped__", action.type)
    if action.choices:
        values = [str(c) for c in action.choices]
        return (values[0], values[1]) if len(values) > 1 else None
    if convert is int:
        return "1", "2"
    if convert is float:
        return "0.1", "0.2"
    if action.nargs in (None, "?") and convert in (None, str):
        return "a", "b"
    return None


def test_a_flag_given_twice_with_different_values_is_an_error_for_every_flag():
    """Generated over every single-valued flag of train_fsdp.py: the same flag twice (a flag appended to a long
    command) with different values, in either spelling (`--x v`, `--x=v`), is one line naming both; the same value
    twice passes. argparse alone keeps the last without a word."""
    from fsdp_recipes.config import helptext
    from fsdp_recipes.config.trl_names import check_flag_aliases

    parser = helptext.build_parser(show_all=True)
    checked = 0
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if not long or action.dest == "help" or (values := _two_values(action)) is None:
            continue
        flag, (a, b) = long[0], values
        for argv in ([flag, a, flag, b], [f"{flag}={a}", flag, b], [flag, a, f"{flag}={b}"]):
            with pytest.raises(
                RecipeError,
                match=re.escape(f"{flag} {a} and {flag} {b} are given twice with different values: give one"),
            ):
                check_flag_aliases(argv, parser)
        # the same value twice
        check_flag_aliases([flag, a, f"{flag}={a}"], parser)
        checked += 1
    # 92 today: every single-valued TrainingArguments field, and ours
    assert checked > 80, checked


def test_a_list_flag_given_twice_with_other_values_is_one_line_naming_the_list_meant():
    """Generated over every list flag (nargs +): argparse keeps the last list, dropping the first without a word; the
    line names both and the one list they make. The same list twice, in either spelling, passes."""
    from fsdp_recipes.config import helptext
    from fsdp_recipes.config.trl_names import check_flag_aliases

    parser = helptext.build_parser(show_all=True)
    lists = [a for a in parser._actions if a.nargs in ("+", "*") and a.option_strings]
    assert {"lora_target_modules", "label_names"} <= {a.dest for a in lists}
    for action in lists:
        flag = next(s for s in action.option_strings if s.startswith("--"))
        a, b = list(map(str, action.choices))[:2] if action.choices else ["q_proj", "v_proj"]
        for argv in ([flag, a, flag, b], [f"{flag}={a}", flag, b], [flag, a, "--seed", "1", flag, a, b]):
            with pytest.raises(RecipeError) as err:
                check_flag_aliases(argv, parser)
            assert str(err.value).endswith(f"with different values: give one list, e.g. {flag} {a} {b}"), err.value
        check_flag_aliases([flag, a, b, "--seed", "1", flag, a, b], parser)
        check_flag_aliases([f"{flag}={a}", flag, a], parser)


@pytest.mark.parametrize("first, second", [("my label", "other"), ("a*", "b c"), ("x", "it's"), ("a b", "a b c")])
def test_a_repeated_flag_is_named_with_its_values_as_a_shell_gives_them(first, second):
    """A value holding a space or a shell character is one value: the line names it quoted, and the list it offers,
    pasted into a shell, gives back each value of both lists, once, in order. Generated over every list flag without
    choices, and a text flag."""
    import shlex

    from fsdp_recipes.config import helptext
    from fsdp_recipes.config.trl_names import check_flag_aliases

    parser = helptext.build_parser(show_all=True)
    lists = [a for a in parser._actions if a.nargs in ("+", "*") and a.option_strings and not a.choices]
    assert lists
    for action in lists:
        flag = next(s for s in action.option_strings if s.startswith("--"))
        with pytest.raises(RecipeError) as err:
            check_flag_aliases([flag, first, "x", "--seed", "1", flag, second], parser)
        said, _, offered = str(err.value).partition(" are given twice with different values: give one list, e.g. ")
        assert said == f"{shlex.join([flag, first, 'x'])} and {shlex.join([flag, second])}", err.value
        assert shlex.split(offered) == [flag, *dict.fromkeys([first, "x", second])], err.value
    with pytest.raises(RecipeError) as err:
        check_flag_aliases(["--run_name", first, "--run_name", second], parser)
    assert str(err.value).startswith(f"--run_name {shlex.quote(first)} and --run_name {shlex.quote(second)} are"), err


@pytest.mark.parametrize("given", ["q_proj,v_proj", "q_proj, v_proj", ",q_proj,v_proj,"])
def test_lora_module_names_joined_by_commas_are_one_line_before_anything_loads(tmp_path, given):
    """argparse and YAML read "q_proj,v_proj" as one module name, which peft finds nowhere after the model loaded."""
    for argv in ([f"--lora_target_modules={given}"], ["--lora_target_modules", "k_proj", given]):
        with pytest.raises(RecipeError) as err:
            parse_args(["--config_name", "assets/tiny-llama", "--output_dir", str(tmp_path), *NO_FSDP, *argv])
        assert str(err.value) == (
            f"lora_target_modules={given!r} is one name with commas in it: give the names apart, e.g. "
            "--lora_target_modules q_proj v_proj (in a recipe, a YAML list)"
        )


def test_a_repeat_is_judged_by_the_value_the_flag_reads():
    """The same value in two spellings passes (5 and 05, true and yes, a bare flag and true); a --no_ flag against
    its flag's true is two values of one setting."""
    from fsdp_recipes.config import helptext
    from fsdp_recipes.config.trl_names import check_flag_aliases

    parser = helptext.build_parser()
    for same in (
        ["--max_steps=5", "--max_steps", "05"],
        ["--use_peft", "--use_peft=True"],
        ["--bf16", "yes", "--bf16"],
    ):
        check_flag_aliases(same, parser)
    negated = [a for a in parser._actions if a.nargs == 0 and a.option_strings[0].startswith("--no_")]
    assert len(negated) >= 5
    for action in negated:
        flag = f"--{action.dest}"
        for argv in ([action.option_strings[0], flag, "true"], [flag, action.option_strings[0]]):
            with pytest.raises(RecipeError, match=f"the same setting \\({action.dest}\\) with different values"):
                check_flag_aliases(argv, parser)


@pytest.mark.parametrize(
    "setting, one_per_document, rows",
    [("", True, 4), ("packing: false\n", True, 4), ("packing: true\n", True, 1)]
    + [("packing: true\npacking_strategy: bfd_split\n", False, 1), ("packing: concat\n", False, 4)],
)
def test_text_is_one_document_per_row_unless_packing_is_asked_as_in_trl(tmp_path, setting, one_per_document, rows):
    """TRL's default for text (packing unset or false) is one document per row, truncated at max_length and padded;
    its packing true (bfd) truncates each document too and batches them in one row without cross-document
    attention; bfd_split splits long documents instead, and concat cuts the joined text into blocks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")
    docs = [line for line in (REPO / "assets" / "data" / "tiny_corpus.txt").read_text().splitlines() if line.strip()]
    _, data_args, _ = parse_args([write(tmp_path, TINY + CORPUS + "block_size: 8\n" + setting), *NO_FSDP])
    dataset, _, collator = build_datasets(data_args, tokenizer)
    assert (len(dataset) == len(docs)) == one_per_document, len(dataset)
    if one_per_document:
        first = tokenizer(docs[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert dataset[0]["input_ids"] == first[:8] == dataset[0]["labels"]
    batch = collator([dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[0] == rows
    # padded rows: the padding is masked and ignored by the loss
    if rows == 4 and one_per_document:
        assert (batch["labels"] == IGNORE_INDEX).sum() == (batch["attention_mask"] == 0).sum()


@pytest.mark.parametrize(
    "setting, said", [("", True), ("assistant_only_loss: true\n", False), ("data_format: chat\n", False)]
)
def test_chat_data_without_assistant_only_loss_says_it_differs_from_trls_default(tmp_path, capsys, setting, said):
    """TRL's default for conversations trains on every token; here only the assistant's: a recipe that does not
    say which (TRL's and the handbook's recipes) is told so in one line."""
    from transformers import AutoTokenizer

    _, data_args, _ = parse_args([write(tmp_path, TINY + CHAT + "block_size: 64\n" + setting), *NO_FSDP])
    build_datasets(data_args, AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama"))
    lines = [line for line in capsys.readouterr().err.splitlines() if "assistant_only_loss" in line]
    assert len(lines) == (1 if said else 0), lines


def test_trl_flags_at_the_value_taken_here_pass_as_in_a_recipe(tmp_path):
    """--padding_free false, --truncation_mode=keep_start (TRL's defaults, what this script does) are taken, as the
    same recipe keys are; --loss_type dft is still refused with its reason."""
    parse_args([write(tmp_path, TINY + CORPUS), "--padding_free", "false", "--truncation_mode=keep_start", *NO_FSDP])
    with pytest.raises(RecipeError, match=re.escape("loss_type (the loss is the model's token-level cross-entropy")):
        parse_args([write(tmp_path, TINY + CORPUS), "--padding_free", "false", "--loss_type", "dft", *NO_FSDP])


@pytest.mark.parametrize(
    "setting, whole", [("assistant_only_loss: false\n", True), ("assistant_only_loss: true\n", False)]
)
def test_assistant_only_loss_false_trains_on_the_whole_conversation_as_in_trl(tmp_path, setting, whole):
    from transformers import AutoTokenizer

    _, data_args, _ = parse_args([write(tmp_path, TINY + CHAT + "block_size: 64\n" + setting), *NO_FSDP])
    dataset, _, _ = build_datasets(data_args, AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama"))
    row = dataset[0]
    assert (row["labels"] == row["input_ids"]) == whole and (IGNORE_INDEX in row["labels"]) == (not whole)
