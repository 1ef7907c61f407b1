"""Which of a checkpoint's stored tensors are the model's weights, under which names.

Every tool names tensors its own way: accelerate and the Trainer store ``model.<name>``,
``dcp.save(model.state_dict())`` stores ``<name>``, torch's ``get_state_dict`` beside its optimizer stores
``model.<name>`` and ``optim.…``, Lightning ``model.<attribute>.<name>``; FSDP1, torch.compile and activation
checkpointing put wrapper names inside them. A merge that guessed would write a model with weights missing, or
with an optimizer's moments as weights, and nothing would say so until the model misbehaved. So the namespace
holding the weights is found by matching the stored names and shapes against the model (``match_namespace``),
with a one-line error naming what was found and what was expected; optimizer namespaces are never weights,
whatever their shapes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_recipes.ckpt.layout import WRAPPER_PREFIXES
from fsdp_recipes.errors import CheckpointError

# annotations only: readers imports this module (clean_name)
if TYPE_CHECKING:
    from fsdp_recipes.ckpt.readers import TensorInfo

# top-level names under which tools store optimizer state beside the model (get_state_dict: optim, accelerate:
# optimizer, Lightning: optimizer_0, ...): never weights, whatever their shapes
OPTIMIZER_NAMESPACE = re.compile(r"^(optim|optimizer|optimizers|optimizer_\d+|optimizer_states?|optim_state)\.")


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass
class WeightMap:
    """Which stored tensor holds each of the model's weights."""

    # model weight name -> source tensor name
    names: dict[str, str]
    # the namespace they were found under ("" for flat keys)
    prefix: str
    # stored tensors outside it (optimizer state, other modules)
    ignored: int = 0
    # stored inside it, not the model's, and dropped by from_pretrained too
    dropped: tuple[str, ...] = ()

    def describe(self) -> str:
        where = f'under "{self.prefix}"' if self.prefix else "at the top level (no prefix)"
        rest = (
            f"; {self.ignored} other stored tensor(s) ignored (optimizer state, other modules)" if self.ignored else ""
        )
        if self.dropped:
            rest += (
                f"; {len(self.dropped)} stored tensor(s) left out that from_pretrained ignores too (e.g. "
                f"{self.prefix}{self.dropped[0]}: an older version's buffers)"
            )
        return f"layout: {len(self.names)} weights {where}{rest}"


def weight_candidates(stored) -> list[str]:
    return [n for n in stored if not OPTIMIZER_NAMESPACE.match(n)]


def guess_namespace(stored: dict[str, TensorInfo]) -> WeightMap | None:
    """The weights without knowing the model: every non-optimizer tensor, under the longest dotted prefix they all
    share. Right for every producer above; ``match_namespace`` has the last word."""
    names = weight_candidates(stored)
    if not names:
        return None
    parts = [n.split(".") for n in names]
    common = []
    for column in zip(*(p[:-1] for p in parts)):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    prefix = "".join(f"{c}." for c in common)
    return WeightMap({n[len(prefix) :]: n for n in names}, prefix, len(stored) - len(names))


def guess_weights(stored: dict[str, TensorInfo], config: dict | None) -> WeightMap | None:
    """guess_namespace, less the output embedding (``lm_head.weight``) where ``config`` (config.json's settings; None:
    not known) ties it to the input embeddings. A tied checkpoint that stores no head is save_pretrained's, under the
    model's own names: every weight then lies under ``model.``, which is no namespace. A guess from names alone, without
    transformers, to start a copy on: ``match_namespace`` has the last word."""
    weights = guess_namespace(stored)
    if weights is None or (config or {}).get("tie_word_embeddings") is not True:
        return weights
    names = {n: s for n, s in weights.names.items() if n != "lm_head.weight"}
    if len(names) == len(weights.names):
        return WeightMap({n: n for n in weight_candidates(stored)}, "", weights.ignored)
    return WeightMap(names, weights.prefix, weights.ignored)


def match_namespace(
    stored: dict[str, TensorInfo],
    expected: dict[str, tuple[int, ...]],
    tied: list[str],
    model_name: str,
    ignorable: Callable[[set[str]], set[str]] | None = None,
) -> WeightMap:
    """The namespace whose names and shapes are the model's, checked: every weight present with its shape, nothing
    unknown inside it but what ``ignorable`` says from_pretrained drops without a word (description.ignored_on_load).
    Raises CheckpointError naming what was found and what was expected."""
    wanted = sorted(set(expected) - set(tied))
    votes: Counter[str] = Counter()
    for n in weight_candidates(stored):
        parts = n.split(".")
        for i in range(len(parts)):
            suffix = ".".join(parts[i:])
            if suffix in expected and tuple(stored[n].shape) == tuple(expected[suffix]):
                votes[".".join(parts[:i]) + ("." if i else "")] += 1
    names = sorted(weight_candidates(stored)) or sorted(stored)
    found = (", ".join(names[:3]) + (", ..." if len(names) > 3 else "")) or "no tensors"
    if not votes:
        raise CheckpointError(
            f"found no weights of {model_name} in the checkpoint: it stores {found}; expected names like {wanted[0]} "
            "(under any prefix) with the config's shapes: pass the right --base-model"
        )
    prefix = max(votes, key=lambda p: (votes[p], -len(p)))
    inside = {n[len(prefix) :]: n for n in weight_candidates(stored) if n.startswith(prefix)}
    missing = [n for n in wanted if n not in inside]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} of the {len(wanted)} weights of {model_name} (e.g. "
            f"{prefix}{missing[0]}); "
            f"it stores {found}: the config does not belong to this checkpoint; pass the right --base-model"
        )
    wrong = [n for n in wanted if tuple(stored[inside[n]].shape) != tuple(expected[n])]
    if wrong:
        n = wrong[0]
        raise CheckpointError(
            f"{n} has shape {tuple(stored[inside[n]].shape)} in the checkpoint but {tuple(expected[n])} in the "
            "config: pass the right --base-model"
        )
    unknown = set(inside) - set(expected)
    dropped = sorted(ignorable(unknown)) if ignorable and unknown else []
    extra = sorted(unknown - set(dropped))
    if extra:
        raise CheckpointError(
            f"the checkpoint has {len(extra)} weight(s) {model_name} does not (e.g. {prefix}{extra[0]}): pass "
            "the right --base-model"
        )
    return WeightMap({n: inside[n] for n in wanted}, prefix, len(stored) - len(inside), tuple(dropped))


def stored_tie_differs(source, weights: WeightMap, tied: dict[str, str]) -> str | None:
    """Why a config's tie does not hold for the checkpoint: it stores a tied weight (``tied``: name -> the name it
    is tied to) under the namespace with values other than its target's. The merged folder writes a tied weight
    once, so from_pretrained would compute with the target in its place; a config of another model, or one edited
    to say tied, must not drop it without a word. Reads the two tensors of each tie stored twice, one at a time (a
    digest of each: never both in memory); None when every tie holds."""
    for name, target in tied.items():
        stored, of = weights.prefix + name, weights.names.get(target)
        if stored not in source.tensors or of is None:
            continue
        dtype = source.tensors[stored].dtype
        if _digest(source, stored, dtype) != _digest(source, of, dtype):
            return (
                f"the config ties {name} to {target}, but the checkpoint stores a {name} of other values (a model "
                "with its own head): the merged model would use the embeddings in its place; pass --base-model "
                "<the model it was trained from>, or set tie_word_embeddings to false in its config.json"
            )
    return None


def _digest(source, name: str, dtype: str) -> bytes:
    """SHA-256 of the stored tensor ``name``'s values as ``dtype`` (a safetensors dtype name) holds them."""
    import hashlib

    import torch

    tensor = source.read([name])[name].to(getattr(torch, dtype)).contiguous()
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).digest()
