"""The embedded default: a tiny Llama-style model, its tokenizer and a small corpus, all made here.

Nothing is downloaded. ``tools/make_tiny_assets.py`` calls :func:`build_all` to (re)generate the files
under ``assets/``; they are committed, and a test checks that regenerating them gives the same bytes.
The corpus is generated from a small grammar so a model of a few hundred thousand parameters can learn
it within a few hundred CPU steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "assets"
CORPUS = ASSETS / "data" / "tiny_corpus.txt"
CHAT = ASSETS / "data" / "tiny_chat.jsonl"

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

# `{% generation %}` marks assistant text, so `return_assistant_tokens_mask` can limit the loss to it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "dtype": "float32",
}

_NAMES = ["Ada", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
_ANIMALS = ["cat", "dog", "fox", "owl", "bee", "hen", "yak", "eel", "ant", "cow"]
_COLORS = ["red", "blue", "green", "gray", "gold", "pink", "black", "white"]
_PLACES = ["the barn", "the lake", "the hill", "the wood", "the town", "the field", "the shop", "the mill"]
_VERBS = ["sees", "feeds", "finds", "follows", "paints", "counts", "calls", "greets"]
_ADVERBS = ["slowly", "quickly", "quietly", "happily", "often", "again"]


def _sentence(rng: random.Random) -> str:
    form = rng.randrange(4)
    name, animal, color = rng.choice(_NAMES), rng.choice(_ANIMALS), rng.choice(_COLORS)
    if form == 0:
        return f"{name} {rng.choice(_VERBS)} the {color} {animal} near {rng.choice(_PLACES)}."
    if form == 1:
        return f"The {animal} walks {rng.choice(_ADVERBS)} to {rng.choice(_PLACES)} with {name}."
    if form == 2:
        n = rng.randrange(2, 10)
        return f"{name} has {n} {animal}s, and {n + 1} is one more than {n}."
    return (
        f"In {rng.choice(_PLACES)} the {animal} is {color}, so {name} {rng.choice(_VERBS)} it {rng.choice(_ADVERBS)}."
    )


def corpus_lines(n_paragraphs: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randrange(3, 7))) for _ in range(n_paragraphs)]


def chat_examples(n: int = 400, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        name, animal, k = rng.choice(_NAMES), rng.choice(_ANIMALS), rng.randrange(2, 10)
        examples.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": f"How many {animal}s does {name} have if {name} has {k} and finds one more?",
                    },
                    {"role": "assistant", "content": f"{name} has {k + 1} {animal}s."},
                ]
            }
        )
    return examples


def build_tokenizer(lines: list[str]):
    """Train a byte-level BPE tokenizer on the corpus and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MODEL_CONFIG["max_position_embeddings"]
    return fast


def build_all(assets: Path = ASSETS) -> list[Path]:
    """Write corpus, chat data, tokenizer and model config under ``assets``; return the files written."""
    from transformers import GenerationConfig, LlamaConfig

    model_dir, data_dir = assets / "tiny-llama", assets / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = corpus_lines()
    (data_dir / "tiny_corpus.txt").write_text("\n".join(lines) + "\n")
    with open(data_dir / "tiny_chat.jsonl", "w") as f:
        for example in chat_examples():
            f.write(json.dumps(example) + "\n")
    tokenizer = build_tokenizer(lines)
    tokenizer.save_pretrained(model_dir)
    # BPE stops merging once the small corpus has no pairs left, so the vocabulary can come out smaller.
    config = LlamaConfig(**{**MODEL_CONFIG, "vocab_size": len(tokenizer)})
    config.save_pretrained(model_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(model_dir)
    return sorted(p for p in assets.rglob("*") if p.is_file())
