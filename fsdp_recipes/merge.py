"""Any FSDP checkpoint -> a Hugging Face model folder, streamed in bounded memory.

Sources: a sharded DCP model folder (FSDP1 or FSDP2, any number of ranks and nodes: ``pytorch_model_fsdp_0``),
or a full state dict (``model.safetensors`` [+ index], ``pytorch_model_fsdp.bin``). Optimizer state is never
read. The safetensors headers are computed up front from the checkpoint's metadata (read without torch:
dcp_files); then each DCP chunk that is a plain record is copied by the kernel (copy_file_range) straight to
its place in the output, and the
rest (casts, other layouts) is read in groups of at most ``memory_budget`` bytes (a larger tensor alone).
Peak memory follows the budget and the largest tensor, never the model size. Output goes to a hidden
folder beside the target and is renamed when complete.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import struct
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.serialization._base import parse_size_to_int
from tqdm.auto import tqdm

from .dcp_files import DTYPE_SIZES, check_folder, raw_tensor

# torch is imported where tensors are handled, not here: a merge of a checkpoint with a manifest only copies
# bytes and never imports it (dcp_files, MANIFEST); otherwise its import overlaps the copy in a thread.

DCP_MODEL_DIR = "pytorch_model_fsdp_0"
FULL_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model_fsdp.bin")
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
MANIFEST = "model_description.json"  # written into each checkpoint by the training run: write_manifest
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


class CheckpointError(ValueError):
    """Bad input: the message names the problem and the fix, on one line."""


def dtype_name(dtype) -> str | None:
    """"bfloat16" for torch.bfloat16 or "bfloat16"; None stays None (keep the saved dtype)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # torch name: "float32"

    def nbytes(self, dtype: str | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE_SIZES[dtype or self.dtype]


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# ----------------------------------------------------------------------------------------------- sources


class DCPSource:
    """A sharded ``torch.distributed.checkpoint`` folder, read without a process group."""

    kind = "sharded (DCP)"

    def __init__(self, dcp_dir: Path):
        self.path = dcp_dir
        layout, problems = check_folder(dcp_dir)
        if problems:
            raise CheckpointError(
                f"checkpoint {dcp_dir} is incomplete: {'; '.join(problems[:3])}; it was not finished writing or was "
                "copied partly: use an earlier checkpoint-N or copy the folder again"
            )
        self._layout = layout
        stored = layout.tensors
        if stored and all(k.startswith("optimizer.") for k in stored):
            raise CheckpointError(f"{dcp_dir} holds optimizer state, not model weights: give {dcp_dir.parent / DCP_MODEL_DIR} or the checkpoint-N folder")
        # accelerate stores {"model": state_dict}; DCP flattens that to "model.<name>"
        self.keys = {clean_name(k.removeprefix("model.")): k for k in stored}
        self.tensors = {n: TensorInfo(stored[k].shape, stored[k].dtype) for n, k in self.keys.items()}
        self.ranks = len({info.relative_path for info in layout.storage.values()})

    def copy_plan(self, name: str) -> list[tuple[Path, int, int, int]] | None:
        """Where the tensor's bytes lie in the .distcp files, as (file, offset, offset in the tensor, bytes), for a
        kernel copy with no tensor in memory. Only for the common layout: every chunk a whole-row (dim-0) slice
        stored as one contiguous, uncompressed, little-endian torch.save record. None when that does not hold."""
        key, info = self.keys[name], self.tensors[name]
        row_bytes = info.nbytes() // info.shape[0] if info.shape and info.shape[0] else 0
        plan = []
        for chunk in self._layout.tensors[key].chunks:
            if not row_bytes or any(chunk.offsets[1:]) or chunk.sizes[1:] != info.shape[1:]:
                return None
            stored = self._layout.storage.get((key, chunk.offsets))
            raw = raw_tensor(self.path, stored) if stored else None
            if raw is None or raw.dtype != info.dtype or raw.shape != chunk.sizes:
                return None
            plan.append((self.path / stored.relative_path, raw.data_offset, chunk.offsets[0] * row_bytes, raw.nbytes))
        return plan if sum(n for *_, n in plan) == info.nbytes() else None

    def read(self, names: list[str]) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp

        buffers = {self.keys[n]: torch.empty(self.tensors[n].shape, dtype=torch_dtype(self.tensors[n].dtype)) for n in names}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        return {n: buffers[self.keys[n]] for n in names}


class SafetensorsSource:
    """``model.safetensors`` or an index of shards. Tensors are laid out as plain bytes: copied by the kernel like
    DCP records (the header is read here, without torch), or read one at a time from memory maps to be cast."""

    kind = "full (safetensors)"

    def __init__(self, folder: Path):
        self.path = folder
        index = folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
        self.ranks = 1
        self.tensors, self._where = {}, {}
        codes = {code: name for name, code in SAFETENSORS_DTYPES.items()}
        for file in files:
            path = folder / file
            if not path.is_file():
                raise CheckpointError(f"{path} is missing ({index.name} names it): copy the checkpoint again")
            with open(path, "rb") as f:
                try:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(length))
                except (struct.error, ValueError, MemoryError, OverflowError):
                    raise CheckpointError(f"{path} is not a readable safetensors file (truncated?): copy the checkpoint again") from None
            end = 0
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if entry["dtype"] not in codes:
                    raise CheckpointError(f"{path}: {key} has dtype {entry['dtype']}, which this tool does not convert")
                begin, stop = entry["data_offsets"]
                self.tensors[clean_name(key)] = TensorInfo(tuple(entry["shape"]), codes[entry["dtype"]])
                self._where[clean_name(key)] = (file, key, 8 + length + begin, stop - begin)
                end = max(end, stop)
            if path.stat().st_size < 8 + length + end:
                raise CheckpointError(f"{path} is truncated ({path.stat().st_size} of {8 + length + end} bytes): copy the checkpoint again")

    def copy_plan(self, name: str) -> list[tuple[Path, int, int, int]] | None:
        file, _, offset, nbytes = self._where[name]
        return [(self.path / file, offset, 0, nbytes)] if nbytes == self.tensors[name].nbytes() else None

    def read(self, names: list[str]) -> dict:
        from safetensors import safe_open

        out = {}
        for n in names:
            file, key, *_ = self._where[n]
            with safe_open(str(self.path / file), framework="pt") as f:
                out[n] = f.get_tensor(key)
        return out


class TorchBinSource:
    """``pytorch_model_fsdp.bin`` (FULL_STATE_DICT, torch.save): memory-mapped, so pages are read on demand."""

    kind = "full (torch.save)"

    def __init__(self, path: Path):
        import torch

        self.path = path
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{path} is unreadable ({type(err).__name__}): the file is truncated or not a torch.save state dict") from None
        self._state = {clean_name(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.tensors = {n: TensorInfo(tuple(t.shape), dtype_name(t.dtype)) for n, t in self._state.items()}
        self.ranks = 1

    def read(self, names: list[str]) -> dict:
        return {n: self._state[n] for n in names}


# ----------------------------------------------------------------------------------------------- input


def checkpoint_steps(run_dir: Path) -> list[Path]:
    found = [p for p in run_dir.glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def checkpoint_problems(ckpt: Path) -> list[str]:
    """Why a checkpoint-N folder cannot be merged (empty when it can)."""
    if (ckpt / DCP_MODEL_DIR).is_dir():
        return check_folder(ckpt / DCP_MODEL_DIR)[1]
    if any((ckpt / f).is_file() for f in FULL_FILES):
        return []
    return [f"no {DCP_MODEL_DIR}/ and no full weights in {ckpt}"]


@dataclass
class ResolvedInput:
    source: object
    checkpoint_dir: Path  # where config/tokenizer are looked for first
    notes: list[str] = field(default_factory=list)


def open_source(folder: Path):
    if (folder / DCP_MODEL_DIR).is_dir():
        return DCPSource(folder / DCP_MODEL_DIR)
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        return SafetensorsSource(folder)
    return TorchBinSource(folder / "pytorch_model_fsdp.bin")


def resolve_input(path: str | os.PathLike) -> ResolvedInput:
    """A checkpoint-N folder, its pytorch_model_fsdp_0 folder, or a run folder (newest complete checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: give a checkpoint-N folder, its {DCP_MODEL_DIR} folder, or a run's output folder")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file: give the folder that holds it (a checkpoint-N folder or {DCP_MODEL_DIR})")
    if p.name.startswith("optimizer"):
        raise CheckpointError(f"{p} holds optimizer state, not model weights: give {p.parent / DCP_MODEL_DIR} or {p.parent}")
    if (p / ".metadata").is_file() or any(p.glob("*.distcp")):
        return ResolvedInput(DCPSource(p), p.parent)
    if (p / DCP_MODEL_DIR).is_dir():
        return ResolvedInput(open_source(p), p)
    steps = checkpoint_steps(p)
    if not steps and any((p / f).is_file() for f in FULL_FILES):
        return ResolvedInput(open_source(p), p)
    if steps:
        notes = []
        for ckpt in steps:
            problems = checkpoint_problems(ckpt)
            if not problems:
                notes.append(f"using {ckpt.name}, the newest complete checkpoint in {p}")
                return ResolvedInput(open_source(ckpt), ckpt, notes)
            notes.append(f"skipping {ckpt.name}: {problems[0]}")
        raise CheckpointError(f"no complete checkpoint in {p} ({'; '.join(notes)}): resume training to write one")
    hints = sorted({str(q.parent) for q in p.glob("*/checkpoint-*")} | {str(q.parent) for q in p.glob("*/*/.metadata")})
    hint = f"; did you mean {hints[0]}?" if hints else f"; expected checkpoint-N/ folders or {DCP_MODEL_DIR}/ inside"
    raise CheckpointError(f"{p} is not a checkpoint{hint}")


# ----------------------------------------------------------------------------------------------- writing


def _safetensors_header(names: list[str], infos: dict[str, TensorInfo], dtype: str | None) -> tuple[bytes, list[tuple[str, int]]]:
    header, offset, layout = {"__metadata__": {"format": "pt"}}, 0, []
    for n in names:
        size = infos[n].nbytes(dtype)
        header[n] = {"dtype": SAFETENSORS_DTYPES[dtype or infos[n].dtype], "shape": list(infos[n].shape), "data_offsets": [offset, offset + size]}
        layout.append((n, size))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, layout


def _groups(names: list[str], infos: dict[str, TensorInfo], budget: int):
    group, size = [], 0
    for n in names:
        if group and size + infos[n].nbytes() > budget:
            yield group
            group, size = [], 0
        group.append(n)
        size += infos[n].nbytes()
    if group:
        yield group


def _copy_range(src: Path, src_offset: int, fd: int, dst_offset: int, count: int) -> None:
    with open(src, "rb") as f:
        while count:
            done = os.copy_file_range(f.fileno(), fd, count, src_offset, dst_offset)
            if done == 0:
                raise CheckpointError(f"{src} ended early: the file is truncated; copy the checkpoint again")
            src_offset, dst_offset, count = src_offset + done, dst_offset + done, count - done


def write_weights(
    source, names: list[str], out_dir: Path, max_shard_size: str | int = "5GB", dtype: str | None = None,
    memory_budget: str | int = "512MB",
) -> list[str]:
    """Stream ``names`` from ``source`` into safetensors shards (+ index) in ``out_dir``, as save_pretrained names them."""
    infos, dtype = source.tensors, dtype_name(dtype)
    budget = parse_size_to_int(memory_budget) if isinstance(memory_budget, str) else memory_budget
    split = split_state_dict_into_shards_factory(
        {n: infos[n] for n in names}, get_storage_size=lambda info: info.nbytes(dtype),
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size,
    )
    total = sum(infos[n].nbytes(dtype) for n in names)
    written = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="Writing weights") as bar:
        for filename, shard_names in split.filename_to_tensors.items():
            header, layout = _safetensors_header(sorted(shard_names), infos, dtype)
            offsets, position = {}, len(header)
            for n, size in layout:
                offsets[n], position = position, position + size
            fd = os.open(out_dir / filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, header)
                # Kernel copies first, in the order the bytes lie in the checkpoint files: read sequentially, the
                # copy runs as fast as `cp` (in layout order it was up to 1.5x slower). Everything else is read,
                # cast and written after, in budgeted groups.
                plans = {n: source.copy_plan(n) for n, _ in layout} if dtype is None and hasattr(source, "copy_plan") else {}
                slow = [n for n, _ in layout if plans.get(n) is None]
                pieces = sorted((src, src_offset, offsets[n] + at, count) for n, plan in plans.items() if plan for src, src_offset, at, count in plan)
                for src, src_offset, dst_offset, count in pieces:
                    _copy_range(src, src_offset, fd, dst_offset, count)
                    bar.update(count)
                for group in _groups(slow, infos, budget):
                    tensors = source.read(group)
                    for n in group:
                        t = tensors.pop(n)
                        t = (t if dtype is None else t.to(torch_dtype(dtype))).contiguous()
                        if t.numel():
                            os.pwrite(fd, t.reshape(-1).view(torch_dtype("uint8")).numpy(), offsets[n])
                        bar.update(infos[n].nbytes(dtype))
                        del t
                os.ftruncate(fd, position)  # only grows the file when trailing tensors are empty
            finally:
                os.close(fd)
            written.append(filename)
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append("model.safetensors.index.json")
    return written


def model_skeleton(config) -> tuple[type, dict[str, tuple[int, ...]], list[str]]:
    """(model class, shape of every state-dict name, tied names save_pretrained leaves out), from a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    tied = sorted(set(getattr(skeleton, "all_tied_weights_keys", None) or {}) & set(expected)) if getattr(config, "tie_word_embeddings", False) else []
    return type(skeleton), expected, tied


def check_weights(source, model_name: str, expected: dict[str, tuple[int, ...]], tied: list[str]) -> list[str]:
    """The names to write (all but the tied ones), after checking the checkpoint holds exactly the model's weights."""
    wanted = sorted(set(expected) - set(tied))
    missing = [n for n in wanted if n not in source.tensors]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} weight(s) of {model_name} (e.g. {missing[0]}): the config does not "
            "belong to this checkpoint; pass the right --base-model"
        )
    wrong = [n for n in wanted if tuple(source.tensors[n].shape) != tuple(expected[n])]
    if wrong:
        n = wrong[0]
        raise CheckpointError(f"{n} has shape {source.tensors[n].shape} in the checkpoint but {tuple(expected[n])} in the config: pass the right --base-model")
    extra = sorted(set(source.tensors) - set(expected))
    if extra:
        raise CheckpointError(f"the checkpoint has {len(extra)} weight(s) {model_name} does not (e.g. {extra[0]}): pass the right --base-model")
    return wanted


def weights_to_write(source, config) -> tuple[type, list[str], list[str]]:
    """(model class, names save_pretrained would write, tied names it leaves out), checked against the checkpoint."""
    model_cls, expected, tied = model_skeleton(config)
    return model_cls, check_weights(source, model_cls.__name__, expected, tied), tied


def describe_folder(out_dir: Path, model_cls: type, config, tokenizer=None, generation_config=None, dtype=None) -> list[str]:
    """config.json (architectures = the model class, never an FSDP wrapper), generation config and tokenizer; returns
    the names of the files written."""
    config.architectures = [model_cls.__name__]
    if dtype is not None:
        config.dtype = torch_dtype(dtype_name(dtype))
    config.save_pretrained(out_dir)
    files = ["config.json"]
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
        files.append("generation_config.json")
    if tokenizer is not None:
        saved = tokenizer.save_pretrained(out_dir)
        files += [Path(f).name for f in saved if Path(f).parent == Path(out_dir) and Path(f).is_file()]
    return sorted(set(files))


def write_manifest(folder: Path, config, files: list[str]) -> None:
    """MANIFEST beside a checkpoint's config.json: what a merge would otherwise import transformers and build the
    model for (its class, the name and shape of every weight, the tied ones), and a hash of each description file,
    so that a merge can copy them as they are, and notices when one was edited since."""
    model_cls, expected, tied = model_skeleton(copy.deepcopy(config))  # from_config edits the config it is given
    manifest = {
        "format": 1, "model_class": model_cls.__name__, "tied": tied,
        "files": {name: _sha256(Path(folder) / name) for name in sorted(files)},
        "weights": {name: list(shape) for name, shape in sorted(expected.items())},
    }
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_model_files(source, out_dir: Path, config, tokenizer=None, generation_config=None, dtype=None,
                      max_shard_size="5GB", memory_budget="512MB") -> list[str]:
    """Weights, config, generation config and tokenizer into ``out_dir``; returns the file names."""
    model_cls, names, _ = weights_to_write(source, config)
    write_weights(source, names, out_dir, max_shard_size=max_shard_size, dtype=dtype, memory_budget=memory_budget)
    describe_folder(out_dir, model_cls, config, tokenizer, generation_config, dtype)
    return sorted(p.name for p in out_dir.iterdir())


# ----------------------------------------------------------------------------------------------- merge


def _description_dirs(resolved: ResolvedInput) -> tuple[Path | None, Path | None]:
    """(folder with config.json, folder with tokenizer files): the checkpoint first, then its run folder."""
    places = [resolved.checkpoint_dir, resolved.checkpoint_dir.parent]
    config_dir = next((d for d in places if (d / "config.json").is_file()), None)
    tok_dir = next((d for d in places if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
    return config_dir, tok_dir


def find_model_files(resolved: ResolvedInput, base_model: str | None):
    """Config, generation config and tokenizer: from the checkpoint, then its run folder, then --base-model."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config_dir, tok_dir = _description_dirs(resolved)
    if config_dir is None and base_model is None:
        raise CheckpointError(f"no config.json in {resolved.checkpoint_dir} or its parent: pass --base-model <hub id or folder the run started from>")
    config_from = base_model if config_dir is None else str(config_dir)
    config = AutoConfig.from_pretrained(config_from)
    if config_dir is not None and (config_dir / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(config_dir)
    else:
        generation_config = GenerationConfig.from_model_config(config)
    tok_from = str(tok_dir) if tok_dir is not None else base_model
    if tok_from is None:
        raise CheckpointError(f"no tokenizer files in {resolved.checkpoint_dir} or its parent: pass --base-model <hub id or folder with the tokenizer>")
    return config, generation_config, AutoTokenizer.from_pretrained(tok_from), {"config": config_from, "tokenizer": tok_from}


@dataclass
class MergeResult:
    output: Path
    files: list[str]
    notes: list[str]
    tensors: int
    bytes: int


def merge_checkpoint(
    input_path: str | os.PathLike, output_path: str | os.PathLike, *, base_model: str | None = None,
    dtype=None, max_shard_size: str | int = "5GB", memory_budget: str | int = "512MB",
    overwrite: bool = False, verify: bool = False, log=print,
) -> MergeResult:
    """Turn an FSDP checkpoint into a folder ``from_pretrained`` loads; never leaves a half-written folder.
    ``dtype``: torch.bfloat16 or "bfloat16" casts, None keeps the saved dtype."""
    dtype = dtype_name(dtype)
    resolved = resolve_input(input_path)
    for note in resolved.notes:
        log(note)
    out = Path(output_path).absolute()
    src_root = (resolved.checkpoint_dir if resolved.checkpoint_dir.name.startswith("checkpoint-") else Path(input_path)).absolute()
    if out == src_root or src_root in out.parents or Path(input_path).absolute() in out.parents:
        raise CheckpointError(f"output {out} is inside the input {Path(input_path)}: choose a folder outside it")
    if out.exists() and not overwrite:
        raise CheckpointError(f"output {out} already exists: choose another folder or pass --overwrite")
    # A checkpoint our training run wrote carries a manifest: its description files are copied and the weights
    # checked against it, with no torch or transformers at all. Otherwise torch + transformers imports and the
    # model skeleton take about 4 s of CPU: when config.json already says nothing is tied, every checkpoint tensor
    # is written, so the copy (which needs neither) starts at once while they load in a thread, and their checks
    # run before anything is renamed into place.
    own = described_by_manifest(resolved) if base_model is None and dtype is None else None
    with ThreadPoolExecutor(1) as pool:
        if own is not None:
            names, description = own.names, lambda: own
        else:
            future = pool.submit(_describe, resolved, base_model, dtype)
            names, description = _untied_names(resolved) or future.result().names, future.result
        size = sum(resolved.source.tensors[n].nbytes(dtype) for n in names)
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        if free < size + (64 << 20):
            raise CheckpointError(f"not enough free disk space in {out.parent}: need {size / 1e9:.2f} GB, have {free / 1e9:.2f} GB; free space or choose another output")
        staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            write_weights(resolved.source, names, staging, max_shard_size=max_shard_size, dtype=dtype, memory_budget=memory_budget)
            described = description()
            if described.names != names:
                raise CheckpointError(f"config.json does not describe this checkpoint's weights (e.g. {sorted(set(described.names) ^ set(names))[0]}): pass the right --base-model")
            log(f"config from {described.origin['config']}, tokenizer from {described.origin['tokenizer']}")
            described.write(staging)
            files = sorted(p.name for p in staging.iterdir())
            if verify:
                verify_folder(staging, resolved.source, names, dtype)
                log(f"verified: {len(names)} tensors equal the checkpoint; from_pretrained (meta device) loads the folder")
            if out.exists():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                out.rename(old)
                staging.rename(out)
                shutil.rmtree(old)
            else:
                staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if described.tied:
        log(f"tied weights written once, as save_pretrained does: {', '.join(described.tied)}")
    return MergeResult(out, files, resolved.notes, len(names), size)


@dataclass
class Description:
    """What goes beside the weights: the names to write, and how to write config, generation config and tokenizer."""

    names: list[str]
    tied: list[str]
    origin: dict[str, str]
    write: Callable[[Path], object]


def _describe(resolved: ResolvedInput, base_model: str | None, dtype: str | None) -> Description:
    config, generation_config, tokenizer, origin = find_model_files(resolved, base_model)
    model_cls, names, tied = weights_to_write(resolved.source, config)
    return Description(names, tied, origin, lambda out: describe_folder(out, model_cls, config, tokenizer, generation_config, dtype))


def described_by_manifest(resolved: ResolvedInput) -> Description | None:
    """The checkpoint's own description (write_manifest), when it has one with a tokenizer and no described file
    changed since; None sends the merge through transformers."""
    config_dir, _ = _description_dirs(resolved)
    if config_dir is None or not (config_dir / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((config_dir / MANIFEST).read_text())
        files, tied = dict(manifest["files"]), list(manifest["tied"])
        expected = {name: tuple(shape) for name, shape in manifest["weights"].items()}
        model_name = str(manifest["model_class"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if manifest.get("format") != 1 or "config.json" not in files or not any(f in files for f in TOKENIZER_FILES):
        return None
    if any(not (config_dir / name).is_file() or _sha256(config_dir / name) != digest for name, digest in files.items()):
        return None
    names = check_weights(resolved.source, model_name, expected, tied)
    origin = {"config": str(config_dir), "tokenizer": str(config_dir)}
    return Description(names, tied, origin, lambda out: [shutil.copyfile(config_dir / name, out / name) for name in files])


def _untied_names(resolved: ResolvedInput) -> list[str] | None:
    """Every checkpoint tensor, when the run's config.json states tie_word_embeddings: false; else None."""
    config_dir, _ = _description_dirs(resolved)
    if config_dir is None:
        return None
    try:
        tied = json.loads((config_dir / "config.json").read_text()).get("tie_word_embeddings")
    except ValueError:
        return None
    return sorted(resolved.source.tensors) if tied is False else None


def verify_folder(folder: Path, source, names: list[str], dtype: str | None = None) -> None:
    """Every tensor re-read from the output equals the checkpoint's (exact), and from_pretrained loads the folder."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    dtype = dtype_name(dtype)
    index = folder / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else {n: "model.safetensors" for n in names}
    if sorted(where) != sorted(names):
        raise CheckpointError(f"verify: {folder} holds {len(where)} tensors, expected {len(names)}")
    for group in _groups(names, source.tensors, 512 << 20):
        expected = source.read(group)
        for n in group:
            with safe_open(str(folder / where[n]), framework="pt") as f:
                got = f.get_tensor(n)
            want = expected[n] if dtype is None else expected[n].to(torch_dtype(dtype))
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise CheckpointError(f"verify: {n} in {folder} differs from the checkpoint")
    AutoModelForCausalLM.from_pretrained(folder, device_map="meta")


def inspect_checkpoint(input_path: str | os.PathLike) -> dict:
    """What a checkpoint holds, without writing anything."""
    resolved = resolve_input(input_path)
    src, ckpt = resolved.source, resolved.checkpoint_dir
    state = ckpt / "trainer_state.json"
    dtypes: dict[str, int] = {}
    for info in src.tensors.values():
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    config_dir, tok_dir = _description_dirs(resolved)
    return {
        "input": str(Path(input_path)),
        "checkpoint": str(ckpt),
        "notes": resolved.notes,
        "format": src.kind,
        "ranks": src.ranks,
        "step": json.loads(state.read_text()).get("global_step") if state.is_file() else None,
        "tensors": len(src.tensors),
        "parameters": sum(i.nbytes() // DTYPE_SIZES[i.dtype] for i in src.tensors.values()),
        "bytes": sum(i.nbytes() for i in src.tensors.values()),
        "dtypes": dtypes,
        "config": str(config_dir / "config.json") if config_dir else None,
        "tokenizer": str(tok_dir) if tok_dir else None,
        "manifest": str(config_dir / MANIFEST) if config_dir and (config_dir / MANIFEST).is_file() else None,
        "optimizer_state": (ckpt / "optimizer_0").is_dir() or (ckpt / "optimizer.bin").is_file(),
    }
