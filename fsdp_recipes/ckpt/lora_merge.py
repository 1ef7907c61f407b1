"""PEFT LoRA checkpoints (a peft model trained under FSDP and saved whole): the base weights with the adapter's
deltas merged in, exactly as peft's ``merge_and_unload`` computes them, or the adapter alone, as
``PeftModel.from_pretrained`` loads it.

peft names a wrapped linear's weight ``<module>.base_layer.weight`` and its adapter ``<module>.lora_A.<adapter>.weight``
and ``<module>.lora_B.<adapter>.weight``; the merged weight is ``W + (B @ A) * scaling`` with scaling ``alpha / r``
(``alpha / sqrt(r)`` with rsLoRA), computed in float32 for half-precision weights as peft does on CPU. Variants whose
merge is not this (DoRA, LoRA on embeddings, LoRA biases, per-module alpha patterns, modules_to_save) are refused
by name rather than merged wrong.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.layout import ADAPTER_CONFIG
from fsdp_recipes.ckpt.readers import SAFETENSORS_DTYPES, TensorInfo
from fsdp_recipes.errors import CheckpointError

# bitsandbytes' 8-bit weights, and 4-bit packed into uint8 storage
QUANTIZED_DTYPES = ("int8", "uint8")
LORA_WEIGHT = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
# name part -> what it is
_UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (use_dora)",
    "lora_embedding_A": "LoRA on embeddings",
    "lora_embedding_B": "LoRA on embeddings",
    "modules_to_save": "modules_to_save",
    "original_module": "modules_to_save",
    "lora_bias": "LoRA biases",
}


def is_lora(names) -> bool:
    return any(".lora_A." in n or ".lora_B." in n or ".base_layer." in n for n in names)


def find_adapter_config(places: list[Path]) -> Path:
    found = next((p / ADAPTER_CONFIG for p in places if (p / ADAPTER_CONFIG).is_file()), None)
    if found is None:
        raise CheckpointError(
            f"this is a PEFT LoRA checkpoint, but there is no {ADAPTER_CONFIG} in "
            f"{' or '.join(str(p) for p in places)}: "
            "copy the adapter_config.json of the run (PeftModel.save_pretrained writes it) beside the checkpoint"
        )
    return found


# far above any adapter trained (r 8 to 256; 65536 is a full-rank 64K-wide linear)
MAX_RANK = 65536
# alpha is r or 2r in every published recipe: far above twice the largest rank, a typo or junk
MAX_ALPHA = 2**20
# read as true/false: "false" would be truthy
_FLAGS = ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _config_problem(config: dict) -> str | None:
    """Why an adapter config's values cannot be merged (or loaded by peft): the first wrong key, or None.
    json reads NaN and Infinity as floats, and every value may be of any JSON type. lora_dropout and
    target_modules are not used by the merge, but PeftModel.from_pretrained reads them from the folder
    --adapter-only writes (a copy of this file)."""
    alpha, r = config["lora_alpha"], config["r"]
    if not _is_number(alpha) or not math.isfinite(alpha) or not 0 < alpha <= MAX_ALPHA:
        return f"lora_alpha {_shown(alpha)} is not a number above 0 and at most {MAX_ALPHA}"
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        return f"r {_shown(r)} is not a whole number from 1 to {MAX_RANK}"
    if "lora_dropout" in config:
        dropout = config["lora_dropout"]
        if not _is_number(dropout) or not math.isfinite(dropout) or not 0 <= dropout < 1:
            return f"lora_dropout {_shown(dropout)} is not a probability from 0 to below 1"
    for key in _FLAGS:
        if key in config and not isinstance(config[key], bool):
            return f"{key} {_shown(config[key])} is not true or false"
    for key, kinds, what in (
        ("peft_type", (str,), "a string"),
        ("base_model_name_or_path", (str, type(None)), "a string or null"),
        ("target_modules", (str, list, type(None)), "a name, a list of names or null"),
        ("rank_pattern", (dict, type(None)), "a mapping or null"),
        ("alpha_pattern", (dict, type(None)), "a mapping or null"),
        ("modules_to_save", (list, type(None)), "a list or null"),
        ("layer_replication", (list, type(None)), "a list or null"),
    ):
        if key in config and not isinstance(config[key], kinds):
            return f"{key} {_shown(config[key])} is not {what}"
    if isinstance(config.get("target_modules"), list) and not all(isinstance(m, str) for m in config["target_modules"]):
        return f"target_modules {_shown(config['target_modules'])} is not a list of names"
    return None


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json, with every value the merge reads checked: a NaN alpha, a rank of 10**12 or 0, a
    "false" flag (truthy) would otherwise merge into NaN or wrong weights with exit 0."""
    try:
        config = load_json(path, ADAPTER_CONFIG, JSON_LIMIT)
    # UnreadableFile: names the file and the fix
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    missing = [key for key in ("lora_alpha", "r") if key not in config]
    if missing:
        raise CheckpointError(
            f"{path} is not a LoRA adapter config (no {' and no '.join(missing)}): copy the run's "
            "adapter_config.json again"
        )
    if problem := _config_problem(config):
        raise CheckpointError(
            f"{path}: {problem}: copy the run's adapter_config.json again (PeftModel.save_pretrained writes it)"
        )
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')} is not LoRA; only LoRA adapters are merged")
    for key, what in (
        ("use_dora", "DoRA"),
        ("alpha_pattern", "per-module alpha (alpha_pattern)"),
        ("lora_bias", "LoRA biases"),
        ("modules_to_save", "modules_to_save"),
        ("layer_replication", "layer_replication"),
    ):
        if config.get(key):
            raise CheckpointError(
                f"{path}: {what} is not supported by this merge: merge with peft's merge_and_unload instead"
            )
    return config


class MergedLoraSource:
    """A source's tensors as the merged model names them: ``<module>.weight`` for each LoRA-wrapped linear (merged
    when read, never copied raw), every other tensor unchanged. The adapter's own tensors are not among them."""

    def __init__(self, base, config: dict):
        self.base, self.ranks, self.path = base, base.ranks, getattr(base, "path", None)
        self.kind = f"{base.kind} + LoRA (merged)"
        self.alpha, self.rslora, self.transpose = (
            float(config["lora_alpha"]),
            bool(config.get("use_rslora")),
            bool(config.get("fan_in_fan_out")),
        )
        for name in base.tensors:
            for part, what in _UNSUPPORTED.items():
                if f".{part}." in name or name.endswith(f".{part}"):
                    raise CheckpointError(
                        f"{name}: {what} is not supported by this merge: merge with peft's merge_and_unload instead"
                    )
        pairs: dict[str, dict[str, str]] = {}
        adapters = set()
        for name in base.tensors:
            if m := LORA_WEIGHT.match(name):
                pairs.setdefault(m["module"], {})[m["ab"]] = name
                adapters.add(m["adapter"])
        if len(adapters) > 1:
            raise CheckpointError(
                f"the checkpoint holds {len(adapters)} adapters ({', '.join(sorted(adapters))}); merge one with "
                "peft's merge_and_unload"
            )
        self.adapter = next(iter(adapters), None)
        self.pairs = pairs
        # peft scales by the config's r (rank_pattern: per module); the merge by lora_A's rows, the same number in
        # any adapter peft can load. A config whose r differs is another run's: its alpha is not this adapter's.
        if not config.get("rank_pattern"):
            for pair in pairs.values():
                if "A" in pair and base.tensors[pair["A"]].shape[0] != config["r"]:
                    raise CheckpointError(
                        f"{pair['A']} has rank {base.tensors[pair['A']].shape[0]} but {ADAPTER_CONFIG} says r "
                        f"{config['r']}: it is another run's config; copy this run's {ADAPTER_CONFIG}"
                    )
        self._merged: dict[str, tuple[str, str, str]] = {}
        self._plain: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, info in base.tensors.items():
            if LORA_WEIGHT.match(name):
                continue
            merged_name = name.replace(".base_layer.", ".")
            module = name.split(".base_layer.")[0]
            if name.endswith(".base_layer.weight") and module in pairs:
                if set(pairs[module]) != {"A", "B"}:
                    raise CheckpointError(
                        f"{module} has lora_{''.join(pairs[module])} but not both lora_A and lora_B: the "
                        "checkpoint is incomplete"
                    )
                self._merged[merged_name] = (name, pairs[module]["A"], pairs[module]["B"])
                a, b = base.tensors[pairs[module]["A"]].shape, base.tensors[pairs[module]["B"]].shape
                delta = (a[-1], b[0]) if self.transpose else (b[0], a[-1])
                if len(info.shape) == 2 and tuple(info.shape) != delta and info.numel == delta[0] * delta[1]:
                    # peft decides fan_in_fan_out per module (GPT-2's Conv1D against a Linear head), its config once
                    raise CheckpointError(
                        f"{name}: lora_B @ lora_A is {delta[0]} x {delta[1]} (fan_in_fan_out "
                        f"{str(self.transpose).lower()} in {ADAPTER_CONFIG}) but the weight is {info.shape[0]} x "
                        f"{info.shape[1]}: modules stored both ways cannot be merged by one setting; merge with "
                        "peft's merge_and_unload instead"
                    )
            else:
                self._plain[merged_name] = name
            self.tensors[merged_name] = info
        orphans = sorted(set(pairs) - {n.split(".base_layer.")[0] for n, *_ in self._merged.values()})
        if orphans:
            raise CheckpointError(
                f"{orphans[0]} has LoRA weights but no base_layer.weight: the checkpoint is incomplete"
            )

    def copy_plan(self, name: str):
        if name in self._merged or not hasattr(self.base, "copy_plan"):
            return None
        return self.base.copy_plan(self._plain[name])

    def merged_into_tied(self, tied: list[str]) -> str | None:
        """A merged weight that the model ties to another (LoRA on a tied lm_head): the first one's name, or None."""
        return next((t for t in tied for merged in self._merged if merged == t or merged.endswith(f".{t}")), None)

    def scaling(self, r: int) -> float:
        return self.alpha / math.sqrt(r) if self.rslora else self.alpha / r

    def read(self, names: list[str]) -> dict:
        import torch

        needed = sorted({k for n in names for k in (self._merged[n] if n in self._merged else (self._plain[n],))})
        got = self.base.read(needed)
        out = {}
        for n in names:
            if n not in self._merged:
                out[n] = got.pop(self._plain[n])
                continue
            # each base weight let go once merged
            weight, a, b = (got.pop(k) for k in self._merged[n])
            # peft's get_delta_weight + merge (safe_merge=False): half precision on CPU goes through float32
            cast = b.dtype in (torch.float16, torch.bfloat16)
            delta = (b.float() @ a.float()) if cast else b @ a
            delta = (delta.T if self.transpose else delta) * self.scaling(a.shape[0])
            # peft adds in place (weight.data += delta): the sum in the wider dtype, kept in the base weight's. Here
            # the adapter trains in fp32 over a bf16 base under mixed precision, and an fp32 sum written where the
            # header says bf16 overwrote the tensors after it (a bf16 LoRA run's final model was garbage)
            out[n] = (weight + (delta.to(b.dtype) if cast else delta)).to(weight.dtype)
            # a merge that overflows is refused, not written with exit 0 (the checked config cannot rule out
            # adapter weights that are themselves huge); a base weight that is already not finite is the
            # checkpoint's own
            if not torch.isfinite(out[n]).all() and torch.isfinite(weight).all():
                raise CheckpointError(
                    f"{n}: merging lora_B @ lora_A x {self.scaling(a.shape[0]):g} into it gives values that are not "
                    f"finite in {str(out[n].dtype).removeprefix('torch.')}: the adapter's weights or lora_alpha "
                    "are far too large; "
                    "is this the run's adapter?"
                )
        return out


def adapter_tensors(source) -> dict[str, str]:
    """peft's saved names (``base_model.model.<module>.lora_A.weight``, the adapter name dropped) -> source names."""
    names = {}
    for name in source.tensors:
        if m := LORA_WEIGHT.match(name):
            start = name.find("base_model.model.")
            saved = f"{m['module']}.lora_{m['ab']}.weight"
            names[saved[start:] if start >= 0 else saved] = name
    return names


def quantized_base(tensors: dict) -> str | None:
    """What says a whole-model LoRA checkpoint's frozen base is quantized (QLoRA): a wrapped module whose stored base
    weight is not out x in elements (bitsandbytes' 4-bit weights are packed, two or four to an element of the storage
    dtype) or is of an integer dtype (8-bit). Such weights cannot be merged, nor written as a model: the merge takes
    the base's weights from the unquantized base model instead. None for a checkpoint of plain weights."""
    pairs: dict[str, dict] = {}
    for name, info in tensors.items():
        if m := LORA_WEIGHT.match(name):
            pairs.setdefault(m["module"], {})[m["ab"]] = info
    for module, pair in sorted(pairs.items()):
        base = tensors.get(f"{module}.base_layer.weight")
        if base is None or set(pair) != {"A", "B"}:
            continue
        out_features, in_features = pair["B"].shape[0], pair["A"].shape[-1]
        if base.numel != out_features * in_features or base.dtype in QUANTIZED_DTYPES:
            return (
                f"{module}.base_layer.weight holds {base.numel:,} {base.dtype} elements for a {out_features} x "
                f"{in_features} "
                "weight (quantized: QLoRA)"
            )
    return None


class AdapterOfQuantized:
    """A whole-model LoRA checkpoint whose base is quantized, seen as an adapter-only checkpoint: its LoRA tensors
    alone (AdapterOnBaseSource puts the unquantized base model's weights beside them)."""

    def __init__(self, source):
        self.source, self.ranks, self.path = source, source.ranks, getattr(source, "path", None)
        self.kind = f"{source.kind}, its quantized base left out"
        self.tensors = {n: info for n, info in source.tensors.items() if LORA_WEIGHT.match(n)}

    def read(self, names: list[str]) -> dict:
        return self.source.read(names)


def frozen_weight_differs(checkpoint, on_base) -> str | None:
    """A QLoRA checkpoint also holds the weights it did not quantize (embeddings, norms, the LM head) as the run
    loaded them: the first of those the base model (``on_base``: AdapterOnBaseSource) holds otherwise, or None. A
    different value means another base than the run's (or a weight the run trained): merged, the result would be
    neither model. One tensor at a time."""
    import torch

    for name, base_name in on_base._base_names.items():
        info = checkpoint.tensors.get(name)
        if (
            info is None
            or name.endswith(".base_layer.weight")
            or info.dtype not in SAFETENSORS_DTYPES
            or info.dtype in QUANTIZED_DTYPES
            or tuple(info.shape) != tuple(on_base.base.tensors[base_name].shape)
        ):
            continue
        mine, theirs = checkpoint.read([name])[name], on_base.base.read([base_name])[base_name]
        # the base's values as they are, or as the run may have loaded them: rounded to bf16 or fp16 (and upcast again
        # for FSDP); nothing else is the same base (a trained weight or another base differs beyond any rounding)
        if not any(
            torch.equal(mine.isnan(), loaded.isnan())
            and torch.equal(mine.masked_fill(mine.isnan(), 0), loaded.masked_fill(loaded.isnan(), 0))
            for loaded in (
                theirs.to(mine.dtype),
                theirs.to(torch.bfloat16).to(mine.dtype),
                theirs.to(torch.float16).to(mine.dtype),
            )
        ):
            return name
    return None


def holds_adapter_only(names) -> bool:
    """The stored tensors are a LoRA adapter alone (an adapter-only checkpoint): no frozen base weight among them."""
    names = list(names)
    return bool(names) and all(LORA_WEIGHT.match(n) for n in names)


class AdapterOnBaseSource:
    """An adapter-only checkpoint's tensors with the base model's weights beside them, named as a whole-model LoRA
    checkpoint names them (``<prefix><module>.base_layer.weight`` for each wrapped module, ``<prefix><name>`` for the
    rest), so that MergedLoraSource merges it like any other. The base is read from its own safetensors files."""

    def __init__(self, adapter, base, base_dir: Path):
        self.adapter, self.base, self.path, self.base_dir = (
            adapter,
            base,
            getattr(adapter, "path", None),
            Path(base_dir),
        )
        self.ranks, self.kind = adapter.ranks, f"{adapter.kind}, adapter only, + base {base_dir}"
        first = next(iter(adapter.tensors))
        start = first.find("base_model.model.")
        if start < 0:
            raise CheckpointError(
                f"{first}: an adapter-only checkpoint names its tensors under base_model.model. (peft's names); "
                "this one does not"
            )
        prefix = first[: start + len("base_model.model.")]
        modules = {m["module"] for n in adapter.tensors if (m := LORA_WEIGHT.match(n))}
        self._base_names: dict[str, str] = {}
        for name in base.tensors:
            module, _, leaf = name.rpartition(".")
            wrapped = f"{prefix}{module}" in modules
            self._base_names[f"{prefix}{module}.base_layer.{leaf}" if wrapped else f"{prefix}{name}"] = name
        unmatched = sorted(
            m
            for m in modules
            if f"{m}.base_layer.weight" not in self._base_names
            or base.tensors[self._base_names[f"{m}.base_layer.weight"]].numel != self._lora_numel(adapter, m)
        )
        if unmatched:
            raise CheckpointError(
                f"{unmatched[0].removeprefix(prefix)} has LoRA weights in the checkpoint but no weight of that "
                "size in the base "
                f"model {base_dir}: it is another model than the one the adapter was trained on; give its base "
                "with --base-model"
            )
        if quantized := next(
            (
                m
                for m in sorted(modules)
                if base.tensors[self._base_names[f"{m}.base_layer.weight"]].dtype in QUANTIZED_DTYPES
            ),
            None,
        ):
            raise CheckpointError(
                f"{quantized.removeprefix(prefix)}.weight in the base model {base_dir} is "
                f"{base.tensors[self._base_names[f'{quantized}.base_layer.weight']].dtype}: a quantized model, "
                "which the "
                "adapter cannot be merged into; give the unquantized base with --base-model"
            )
        self.tensors = {**{n: base.tensors[b] for n, b in self._base_names.items()}, **adapter.tensors}

    @staticmethod
    def _lora_numel(adapter, module: str) -> int:
        """The elements of the weight lora_B @ lora_A is added to: out x in."""
        a = next(info for n, info in adapter.tensors.items() if n.startswith(f"{module}.lora_A."))
        b = next(info for n, info in adapter.tensors.items() if n.startswith(f"{module}.lora_B."))
        return a.shape[-1] * b.shape[0]

    def copy_plan(self, name: str):
        if name in self._base_names and hasattr(self.base, "copy_plan"):
            return self.base.copy_plan(self._base_names[name])
        return None

    def read(self, names: list[str]) -> dict:
        from_base = [n for n in names if n in self._base_names]
        out = self.base.read([self._base_names[n] for n in from_base]) if from_base else {}
        out = {n: out[self._base_names[n]] for n in from_base}
        rest = [n for n in names if n not in self._base_names]
        if rest:
            out.update(self.adapter.read(rest))
        return out


def base_weights(base_model: str | None, adapter_config: dict, config_path: Path):
    """(the safetensors source, its folder) of the base an adapter-only checkpoint is merged into: ``--base-model``,
    else
    the local folder adapter_config.json names (base_model_name_or_path); a hub id the run downloaded is read from the
    local cache's snapshot (never downloaded here)."""
    from fsdp_recipes.ckpt.base_identity import local_folder
    from fsdp_recipes.ckpt.readers import SafetensorsSource

    named = adapter_config.get("base_model_name_or_path")
    folder = local_folder(base_model or named) if (base_model or named) else None
    if folder is None or not (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    ):
        given = (
            f"--base-model {base_model}"
            if base_model
            else f"{config_path} names {named!r}"
            if named
            else f"{config_path} names no base"
        )
        raise CheckpointError(
            f"this checkpoint holds the LoRA adapter alone (not the frozen base) and {given}, which is not a "
            "local folder "
            "with safetensors weights: pass --base-model <the folder of the model the adapter was trained on>"
        )
    return SafetensorsSource(folder), folder
