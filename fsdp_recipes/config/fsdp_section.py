"""The rules of an accelerate config's fsdp_config section alone: its version, true/false keys, settings of the
other FSDP version, sharding strategy, prefetch, state-dict type, wrap policy, and the settings that cost or
that need another key. ``check_fsdp_keys`` returns what the later checks read (version, strategy, state-dict type,
wrap policy).
"""

from __future__ import annotations

from fsdp_recipes.config.problems import Checker, as_bool, suggest

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
STATE_DICT_TYPES = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]
WRAP_POLICIES = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
BOOL_KEYS = [
    "fsdp_offload_params",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
    "fsdp_forward_prefetch",
    "fsdp_activation_checkpointing",
    "fsdp_activation_checkpointing_offload",
]
FSDP1_ONLY = ["fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_use_orig_params"]
FSDP2_ONLY = ["fsdp_reshard_after_forward"]


def check_fsdp_keys(c: Checker, fsdp: dict) -> tuple:
    """The fsdp_config section alone; returns (version, sharding strategy, state-dict type, wrap policy)."""
    version = fsdp.get("fsdp_version")
    if version is None:
        c.error("fsdp_config.fsdp_version", "missing: accelerate then defaults to FSDP1", "set fsdp_version: 2 (or 1)")
        version = 1
    elif str(version) not in ("1", "2"):
        c.error("fsdp_config.fsdp_version", f"{version!r} is not 1 or 2", "set fsdp_version: 2 (or 1)")
        version = 1
    version = int(version)

    for key in BOOL_KEYS + (["fsdp_reshard_after_forward"] if version == 2 else []):
        if key in fsdp and as_bool(fsdp[key]) is None:
            c.error(f"fsdp_config.{key}", f"{fsdp[key]!r} is not true or false", f"set {key}: true or false")

    strategy = fsdp.get("fsdp_sharding_strategy")
    if version == 2:
        for key in FSDP1_ONLY:
            if key in fsdp:
                fix = (
                    "use fsdp_reshard_after_forward: true (FULL_SHARD) or false (SHARD_GRAD_OP)"
                    if key == "fsdp_sharding_strategy"
                    else f"remove {key}"
                )
                c.error(f"fsdp_config.{key}", "is an FSDP1 setting; fsdp_version: 2 ignores it", fix)
    else:
        for key in FSDP2_ONLY:
            if key in fsdp:
                c.error(
                    f"fsdp_config.{key}",
                    "is an FSDP2 setting under fsdp_version: 1",
                    "use fsdp_sharding_strategy: FULL_SHARD or SHARD_GRAD_OP",
                )
        if strategy is not None:
            if isinstance(strategy, int) or (isinstance(strategy, str) and strategy.isdigit()):
                n = int(strategy)
                if 1 <= n <= len(STRATEGIES):
                    c.warn(
                        "fsdp_config.fsdp_sharding_strategy",
                        f"the legacy integer {n} means {STRATEGIES[n - 1]}",
                        f"write fsdp_sharding_strategy: {STRATEGIES[n - 1]}",
                    )
                    strategy = STRATEGIES[n - 1]
                else:
                    c.error(
                        "fsdp_config.fsdp_sharding_strategy",
                        f"integer {n} is not 1-5",
                        f"use one of {', '.join(STRATEGIES)}",
                    )
            elif strategy not in STRATEGIES:
                c.error(
                    "fsdp_config.fsdp_sharding_strategy",
                    f"{strategy!r} is not a strategy",
                    suggest(str(strategy), STRATEGIES, "values"),
                )
        prefetch = fsdp.get("fsdp_backward_prefetch")
        if prefetch is not None and prefetch not in PREFETCH:
            c.error(
                "fsdp_config.fsdp_backward_prefetch",
                f"{prefetch!r} is not one of {', '.join(PREFETCH)}",
                "use BACKWARD_PRE",
            )
        elif prefetch == "BACKWARD_POST":
            c.warn(
                "fsdp_config.fsdp_backward_prefetch",
                "BACKWARD_POST overlaps less communication than BACKWARD_PRE",
                "use BACKWARD_PRE unless memory is tight",
            )
        if fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT") == "FULL_STATE_DICT" and as_bool(
            fsdp.get("fsdp_use_orig_params", True)
        ):
            # train_fsdp.py refuses such a resume: measured, its first update differs from the run that never stopped
            c.warn(
                "fsdp_config.fsdp_state_dict_type",
                "FULL_STATE_DICT with fsdp_use_orig_params: true (FSDP1) writes checkpoints "
                "that do not resume exactly (torch 2.13)",
                "use SHARDED_STATE_DICT (every shipped config), or fsdp_use_orig_params: false",
            )

    sd_type = fsdp.get("fsdp_state_dict_type")
    if sd_type is not None and sd_type not in STATE_DICT_TYPES:
        c.error(
            "fsdp_config.fsdp_state_dict_type",
            f"{sd_type!r} is not a state-dict type",
            suggest(str(sd_type), STATE_DICT_TYPES, "values"),
        )
    if version == 2 and sd_type == "LOCAL_STATE_DICT":
        c.error(
            "fsdp_config.fsdp_state_dict_type", "LOCAL_STATE_DICT does not exist in FSDP2", "use SHARDED_STATE_DICT"
        )
    wrap = fsdp.get("fsdp_auto_wrap_policy")
    if wrap is not None and wrap not in WRAP_POLICIES:
        c.error(
            "fsdp_config.fsdp_auto_wrap_policy",
            f"{wrap!r} is not a wrap policy",
            f"use one of {', '.join(WRAP_POLICIES)}",
        )
    if wrap != "TRANSFORMER_BASED_WRAP" and "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        c.warn(
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
            f"ignored: the wrap policy is {wrap}",
            "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP or remove the key",
        )
    if (names := fsdp.get("fsdp_transformer_layer_cls_to_wrap")) is not None and not layer_class_names(names):
        shown = repr(names)
        c.error(
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
            f"{shown if len(shown) <= 80 else shown[:80] + '...'} is not a class name, nor class names joined by "
            "commas (accelerate splits it at each ',' and looks for a module class of exactly each name)",
            "give the decoder layer's class name, e.g. LlamaDecoderLayer (several: LlamaDecoderLayer,LlamaMLP, "
            "no spaces), or remove the key to wrap the model's own _no_split_modules",
        )
    if wrap != "SIZE_BASED_WRAP" and "fsdp_min_num_params" in fsdp:
        c.warn(
            "fsdp_config.fsdp_min_num_params",
            f"ignored: the wrap policy is {wrap}",
            "remove it, or set fsdp_auto_wrap_policy: SIZE_BASED_WRAP",
        )

    if as_bool(fsdp.get("fsdp_cpu_ram_efficient_loading")) and not as_bool(fsdp.get("fsdp_sync_module_states")):
        c.error(
            "fsdp_config.fsdp_cpu_ram_efficient_loading",
            "needs fsdp_sync_module_states: true (ranks other than 0 would keep empty weights)",
            "add fsdp_sync_module_states: true",
        )
    if as_bool(fsdp.get("fsdp_offload_params")):
        c.warn(
            "fsdp_config.fsdp_offload_params",
            "CPU offload makes each step several times slower",
            "use it only when zero3 does not fit, even with activation checkpointing",
        )

    return version, strategy, sd_type, wrap


def layer_class_names(value) -> list[str]:
    """The class names accelerate reads from fsdp_transformer_layer_cls_to_wrap (one string, split at each ','), or
    [] when any of them cannot be a class's name: a YAML list (accelerate would split its str()), a space, an empty
    name, code."""
    names = value.split(",") if isinstance(value, str) else []
    return names if names and all(name.isidentifier() for name in names) else []
