"""Every private symbol of torch, accelerate, transformers, huggingface_hub and numpy that this repository touches.

Private names move between releases without notice. A renamed one must not turn a patch into dead code (the
CPU run would then silently train DDP again), an override into a method nobody calls, or an attribute read into
a traceback from deep inside a run. So each one is named here, with why we need it, and the code reaches it only
through :func:`get`, :func:`patch`, :func:`attr`, :func:`set_attr` and :func:`require`: a symbol that is gone stops the
run with
one line naming it, the installed version and the version requirements.txt pins. ``tests/unit/compat/test_internals.py``
scans the code for private accesses that bypass this module and checks every name here resolves.

Kinds: ``module`` names something importable (a function, a class attribute, a method); ``instance`` names an
attribute that only objects have (checked by :func:`attr` when read and by :func:`set_attr` before it is set);
``override`` names a private method of a
library class that one of our subclasses overrides (checked by :func:`require` when the subclass is created).
"""

from __future__ import annotations

import importlib
from importlib import metadata

from fsdp_recipes.errors import InternalsChanged

MODULE, INSTANCE, OVERRIDE = "module", "instance", "override"

PRIVATE: dict[str, tuple[str, str]] = {
    # fsdp_recipes/compat/cpu_fsdp.py: real FSDP without an accelerator (docs/cpu.md)
    "accelerate.state.AcceleratorState._shared_state": (MODULE, "cpu_fsdp: was the state built before this call"),
    "accelerate.state.PartialState._shared_state": (MODULE, "cpu_fsdp: FSDP mirrored into the shared state"),
    "accelerate.state.AcceleratorState._mixed_precision": (INSTANCE, "cpu_fsdp: the plugin's mixed precision"),
    # tests/helpers/trl_recipe_sequence.py: several runs one after another in one launch's processes
    "accelerate.state.AcceleratorState._reset_state": (MODULE, "the recipe sequence: the next run's state afresh"),
    "accelerate.state.GradientState._reset_state": (MODULE, "the recipe sequence: the next run's state afresh"),
    "torch._dynamo.reset": (MODULE, "the recipe sequence: the next run compiles afresh, as a new process would"),
    # fsdp_recipes/config: the modes torch.compile takes, for dynamo_mode and torch_compile_mode
    "torch._inductor.list_mode_options": (MODULE, "config: a compile mode torch.compile does not know, refused"),
    # tests/helpers/train_with_fault.py: a rank killed while it writes its RNG state
    "transformers.trainer.Trainer._save_rng_state": (MODULE, "fault injection: the kill before a rank's RNG file"),
    # tests/helpers/accelerate_oracle.py: what accelerate's launcher gives the ranks, the config tests' oracle
    "accelerate.commands.launch._validate_launch_command": (MODULE, "the launcher's oracle: its config file in force"),
    "torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states": (
        MODULE,
        "cpu_fsdp: FSDP1's CPU-parameter check skipped (the gloo broadcast works)",
    ),
    "torch.distributed.fsdp._flat_param.FlatParamHandle.to_cpu": (
        MODULE,
        "cpu_fsdp: a no-op on CPU (FULL_STATE_DICT with offload_to_cpu segfaults rank 0)",
    ),
    "torch.distributed.distributed_c10d._set_pg_timeout": (
        MODULE,
        "cpu_fsdp: --ddp_timeout on CPU, where transformers drops it",
    ),
    "torch.distributed.fsdp._init_utils._init_intra_and_inter_node_groups": (
        MODULE,
        "cpu_fsdp: FSDP1 HYBRID_SHARD's node is the node's processes on CPU (its device count is 1)",
    ),
    # fsdp_recipes/config/memory.py, recipe_checks.py: the decoder layer class, the unit FSDP wraps
    "transformers.PreTrainedModel._no_split_modules": (
        INSTANCE,
        "the layer class a model names for FSDP's auto-wrap (None where it names none)",
    ),
    # fsdp_recipes/train/sharding.py: modules compiled in place (module.compile: accelerate's regional compilation)
    "torch.nn.Module._compiled_call_impl": (INSTANCE, "the report's compiled_modules"),
    # fsdp_recipes/train/sharding.py: FSDP1's flat parameters, for per-rank elements and bytes
    "torch.distributed.fsdp.FullyShardedDataParallel._handle": (INSTANCE, "sharding: an FSDP1 unit's flat parameter"),
    "torch.distributed.fsdp._flat_param.FlatParameter._unpadded_unsharded_size": (
        INSTANCE,
        "sharding: elements of a unit",
    ),
    "torch.distributed.fsdp._flat_param.FlatParameter._sharded_size": (
        INSTANCE,
        "sharding: elements of this rank's shard",
    ),
    "torch.distributed.fsdp._flat_param.FlatParameter._shard_numel_padded": (
        INSTANCE,
        "sharding: padding in the shard",
    ),
    # fsdp_recipes/train/optimizer.py: ZeRO-1's optimizer
    "torch.distributed.optim.ZeroRedundancyOptimizer._all_state_dicts": (
        INSTANCE,
        "optimizer: ZeRO-1 state gathered in one copy",
    ),
    # fsdp_recipes/train/trainer.py: FSDPTrainer
    "torch.distributed.checkpoint.state_dict._init_optim_state": (
        MODULE,
        "trainer: FSDP1 sharded resume restores Adam",
    ),
    "transformers.Trainer._save_checkpoint": (OVERRIDE, "trainer: no rewrite in place; rotation after every rank"),
    "transformers.Trainer._finalize_training": (
        OVERRIDE,
        "trainer: the end-of-training cleanup done by our rotation, after the background save",
    ),
    "transformers.Trainer._save_optimizer_and_scheduler": (
        OVERRIDE,
        "trainer: LoRA checkpoints, adapter-only or whole",
    ),
    "transformers.Trainer._load_from_checkpoint": (OVERRIDE, "trainer: LoRA checkpoints, adapter-only or whole"),
    "transformers.Trainer._load_optimizer_and_scheduler": (OVERRIDE, "trainer: FSDP1 sharded resume restores Adam"),
    "transformers.Trainer._load_best_model": (
        OVERRIDE,
        "trainer: a LoRA run's best checkpoint loaded as a resume loads it",
    ),
    "transformers.Trainer._get_output_dir": (MODULE, "trainer: the folder a checkpoint goes to"),
    # fsdp_recipes/compat/torch_dcp.py: torch's DCP reader unpickles .metadata and byte records only after our
    # allow-lists (fsdp_recipes/ckpt/dcp_pickles.py)
    "torch.distributed.checkpoint.filesystem.FileSystemReader._get_metadata_path": (
        MODULE,
        "torch_dcp: the .metadata torch reads",
    ),
    "torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata": (
        MODULE,
        "torch_dcp: .metadata vetted first (patched)",
    ),
    "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes": (
        MODULE,
        "torch_dcp: byte records vetted first (patched)",
    ),
    # fsdp_recipes/compat/host_copy.py: background saves stage into one host copy reused by every checkpoint
    "torch.distributed._state_dict_utils._create_cpu_state_dict": (
        MODULE,
        "host_copy: the host copy, made once (torch's own stager's helper)",
    ),
    "torch.distributed._state_dict_utils._copy_state_dict": (
        MODULE,
        "host_copy: each save copied into it (torch's own stager's helper)",
    ),
    "torch.distributed.tensor.DTensor._local_tensor": (
        INSTANCE,
        "host_copy: the first host copy's DTensors hold buffers made ahead (as torch's helper sets them)",
    ),
    # fsdp_recipes/compat/rank0_loading.py: rank-0-only loading without a full copy on the other ranks
    "accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict": (
        MODULE,
        "rank0_loading: FSDP2, rank 0 scatters, not broadcasts (patched)",
    ),
    "torch.distributed.fsdp._init_utils._sync_params_and_buffers": (
        MODULE,
        "rank0_loading: FSDP1 on CPU, broadcast tensor by tensor (patched)",
    ),
    "torch.distributed.fsdp._init_utils._sync_module_params_and_buffers": (
        MODULE,
        "rank0_loading: FSDP1 on CPU, a unit's buffers only (patched)",
    ),
    "torch.distributed.fsdp._flat_param.FlatParamHandle.flatten_tensors_into_flat_param": (
        MODULE,
        "rank0_loading: FSDP1 on CPU, the flat parameter filled from rank 0 (patched)",
    ),
    "torch.distributed.fsdp._flat_param.FlatParameter": (
        MODULE,
        "rank0_loading: FSDP1 on CPU, another rank's untouched flat parameter",
    ),
    "torch.distributed.fsdp._flat_param.FlatParamHandle._get_shard": (
        MODULE,
        "rank0_loading: FSDP1 on CPU, the chunk a rank received kept as its shard, not cloned (patched)",
    ),
    "torch.distributed.fsdp._flat_param.FlatParamHandle._get_unpadded_shard": (
        MODULE,
        "rank0_loading: FSDP1 on CPU, the padding of a shard kept as received",
    ),
    "torch.distributed.fsdp._flat_param.FlatParamHandle._fully_sharded_module": (
        INSTANCE,
        "rank0_loading: the unit a flat parameter is for",
    ),
    # fsdp_recipes/compat/trainer_checkpoints.py: adapter-only LoRA checkpoints (SHARDED), whole-model ones (FULL)
    "transformers.trainer.get_fsdp_ckpt_kwargs": (
        MODULE,
        "trainer_checkpoints: whole-model LoRA checkpoints (swapped)",
    ),
    "accelerate.utils.fsdp_utils._get_model_state_dict": (
        MODULE,
        "trainer_checkpoints: the adapter's every-rank slices (patched)",
    ),
    "accelerate.utils.fsdp_utils._set_model_state_dict": (
        MODULE,
        "trainer_checkpoints: the adapter loaded back (patched)",
    ),
    # fsdp_recipes/config/trainer_fsdp.py: the fsdp_config keys TrainingArguments reads, from its own code
    "transformers.training_args.TrainingArguments._process_fsdp_args": (
        MODULE,
        "trainer_fsdp: --fsdp_config keys it reads",
    ),
    # fsdp_recipes/train/profiling.py: PyTorch's memory viewer snapshot (CUDA only)
    "torch.cuda.memory._record_memory_history": (MODULE, "profiling: CUDA memory snapshot"),
    "torch.cuda.memory._snapshot": (MODULE, "profiling: what was live at the profiled steps' peak (summary.json)"),
    # fsdp_recipes/ckpt/description.py: which stored names from_pretrained drops without a word (old Llama inv_freq)
    "transformers.modeling_utils.PreTrainedModel._adjust_missing_and_unexpected_keys": (
        MODULE,
        "description: stored tensors from_pretrained ignores are left out of a merge, not refused",
    ),
    # fsdp_recipes/config/packages.py: the package each --optim needs, by the function transformers builds it with
    "transformers.trainer_optimizer._OPTIMIZER_HANDLERS": (MODULE, "packages: which package each --optim needs"),
    # fsdp_recipes/ckpt/checkpoint_files.py: numpy's array unpickler, allowed in RNG state files as the Trainer
    # allows it
    "numpy._core.multiarray._reconstruct": (MODULE, "checkpoint_files: RNG state files load with weights_only"),
    # fsdp_recipes/compat/hub_deadline.py: the library's own client, with a deadline hook added
    "huggingface_hub.utils._http.default_client_factory": (
        MODULE,
        "hub_deadline: huggingface_hub's HTTP client, to which every request's deadline is added",
    ),
    "huggingface_hub.constants.HF_HUB_DISABLE_XET": (
        MODULE,
        "hub_deadline: an upload's files over LFS and the HTTP client (read at each upload), not hf_xet's shard "
        "upload, which has no read timeout",
    ),
    # fsdp_recipes/ckpt/safetensors_writer.py, bench/merge_benchmark.py: "5GB" -> bytes as huggingface_hub reads it
    "huggingface_hub.serialization._base.parse_size_to_int": (
        MODULE,
        "merge: shard sizes as huggingface_hub reads them",
    ),
}


def _package(path: str) -> str:
    return path.split(".", 1)[0].replace("_", "-")


def pinned(package: str) -> str | None:
    """The version requirements.txt pins, when this is a checkout that has it."""
    from fsdp_recipes.tiny import REPO_ROOT

    requirements = REPO_ROOT / "requirements.txt"
    try:
        lines = requirements.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, version = line.split("#", 1)[0].strip().partition("==")
        if name.strip().lower().replace("_", "-") == package:
            return version.strip()
    return None


def problem(path: str, detail: str = "") -> InternalsChanged:
    package = _package(path)
    try:
        installed = f"{package} {metadata.version(package)}"
    except metadata.PackageNotFoundError:
        installed = f"{package} (not installed)"
    pin = pinned(package)
    want = f"{package}=={pin}, the version requirements.txt pins" if pin else "the version requirements.txt pins"
    why = PRIVATE.get(path, ("", "unregistered"))[1]
    return InternalsChanged(
        f"{installed} has no {path}{detail}, a private symbol this repository needs ({why}); it was tested with "
        f"{want}: "
        f"install it with `pip install -r requirements.txt`"
    )


def _registered(path: str, *kinds: str) -> None:
    if path not in PRIVATE or PRIVATE[path][0] not in kinds:
        raise KeyError(f"{path} is not registered as {'/'.join(kinds)} in fsdp_recipes/compat/internals.py's PRIVATE")


def _resolve(path: str):
    """Import the longest importable prefix, then walk attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                raise problem(path)
            obj = getattr(obj, name)
        return obj
    raise problem(path)


def get(path: str):
    """The object a registered ``module`` symbol names."""
    _registered(path, MODULE)
    return _resolve(path)


def patch(path: str, replacement) -> object:
    """Replace a registered symbol on its owner; return the original. A missing one is an error, never a new
    attribute that nothing calls."""
    _registered(path, MODULE)
    original = _resolve(path)
    owner_path, name = path.rsplit(".", 1)
    setattr(_resolve(owner_path), name, replacement)
    return original


def attr(obj, path: str):
    """A registered ``instance`` attribute of ``obj``."""
    _registered(path, INSTANCE)
    name = path.rsplit(".", 1)[1]
    try:
        return getattr(obj, name)
    except AttributeError:
        raise problem(path, f" (on {type(obj).__name__})") from None


def set_attr(obj, path: str, value) -> None:
    """Set a registered ``instance`` attribute that ``obj`` already has (never a new one nothing reads)."""
    attr(obj, path)
    setattr(obj, path.rsplit(".", 1)[1], value)


def require(*paths: str) -> None:
    """Check that registered symbols exist (overrides: before the subclass relies on the base calling them)."""
    for path in paths:
        _registered(path, MODULE, OVERRIDE)
        _resolve(path)


def check_all() -> list[str]:
    """Every ``module`` and ``override`` symbol that does not resolve in the installed libraries (CUDA-only ones
    resolve on CPU builds too: they are Python functions)."""
    missing = []
    for path, (kind, _) in PRIVATE.items():
        if kind == INSTANCE:
            continue
        try:
            _resolve(path)
        except InternalsChanged:
            missing.append(path)
    return missing
