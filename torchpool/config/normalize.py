"""Triton's rules and defaults for a model configuration (its JSON form).

`normalize` takes a dictionary that `conform_message` has already checked
field by field and applies what Triton's `NormalizeModelConfig` and
`ValidateModelConfig` do: required fields, dims and reshape, batch inputs
and outputs, instance groups (KIND_AUTO resolved for this host), version
policy, the schedulers' defaults, warmup samples. The result is the `raw`
form `model_config()` answers, a valid input to `normalize` again.
Problems raise `FieldError(path, message)`.
"""
from __future__ import annotations

from typing import Collection, Mapping, Optional, Sequence, cast

from .errors import fail
from .schema import BATCH_INPUT_KIND_ENUM, BATCH_OUTPUT_KIND_ENUM
from .jsonvalue import JSONObject
from .shapes import (
    BatchInput, BatchOutput, DynamicBatching, InstanceGroupEntry, QueuePolicy, RawConfig, SequenceBatching,
    TensorEntry, VersionPolicy,
)
from .warmup import normalize_warmup

__all__ = ["normalize", "PLATFORM", "BACKEND", "WILDCARD_DIM"]

PLATFORM = "pytorch_libtorch"
BACKEND = "pytorch"
DEFAULT_MODEL_FILENAME = "model.pt"
SEQUENCE_IDLE_DEFAULT_MICROSECONDS = 1_000_000
VERSION_POLICIES = ("latest", "all", "specific")
BATCH_INPUT_DATA_TYPES = ("TYPE_INT32", "TYPE_FP32")
WILDCARD_DIM = -1

# The order of the canonical keys in `raw`; other keys follow as written.
_CANONICAL_ORDER = (
    "name", "platform", "backend", "max_batch_size", "input", "output",
    "batch_input", "batch_output", "instance_group", "version_policy",
    "default_model_filename", "parameters", "dynamic_batching", "sequence_batching",
    "model_warmup",
)


def normalize(conformed: JSONObject, gpus: Sequence[int]) -> RawConfig:
    """The `raw` form of a conformed configuration; `gpus` are the GPU ids
    visible on this host (KIND_AUTO becomes KIND_GPU on them, else KIND_CPU)."""
    cfg = cast(RawConfig, conformed)    # conform_message made every field of its schema type
    name = _normalize_name(cfg)
    _check_platform(cfg)
    max_batch_size = cfg.get("max_batch_size", 0)
    if max_batch_size < 0:
        fail("max_batch_size", f"'max_batch_size' must be non-negative value for {name}, got {max_batch_size}")
    _normalize_tensors(cfg.get("input", []), "input", max_batch_size)
    _normalize_tensors(cfg.get("output", []), "output", max_batch_size)
    input_names = [t["name"] for t in cfg["input"]]
    output_names = [t["name"] for t in cfg["output"]]
    cfg["platform"], cfg["backend"], cfg["max_batch_size"] = PLATFORM, BACKEND, max_batch_size
    cfg["batch_input"] = _normalize_batch_inputs(cfg, input_names)
    cfg["batch_output"] = _normalize_batch_outputs(cfg, input_names, output_names)
    cfg["instance_group"] = _normalize_instance_groups(cfg, name, gpus)
    cfg["version_policy"] = _normalize_version_policy(cfg.get("version_policy"))
    cfg["default_model_filename"] = cfg.get("default_model_filename") or DEFAULT_MODEL_FILENAME
    cfg["parameters"] = {k: {"string_value": v.get("string_value", "")}
                         for k, v in cfg.get("parameters", {}).items()}
    _normalize_dynamic_batching(cfg, max_batch_size)
    _normalize_sequence_batching(cfg, max_batch_size)
    if "model_warmup" in cfg:
        cfg["model_warmup"] = normalize_warmup(cfg)
    return _in_canonical_order(cfg)


def _in_canonical_order(cfg: Mapping[str, object]) -> RawConfig:
    ordered = {k: cfg[k] for k in _CANONICAL_ORDER if k in cfg}
    ordered.update((k, v) for k, v in cfg.items() if k not in ordered)
    return cast(RawConfig, ordered)     # the same fields, reordered


def _normalize_name(cfg: RawConfig) -> str:
    name = cfg.get("name", "")
    if not name:
        fail("name", "model configuration must specify 'name'")
    return name


def _check_platform(cfg: RawConfig) -> None:
    """Only TorchScript models are served; missing both means "pytorch" (Triton
    would guess from the model file, and `model.pt` is PyTorch's)."""
    platform, backend = cfg.get("platform", ""), cfg.get("backend", "")
    only = f"(only {PLATFORM} / backend {BACKEND})"
    if platform and platform != PLATFORM:
        fail("", f"platform '{platform}' is not served by torchpool {only}")
    if backend and backend != BACKEND:
        fail("", f"backend '{backend}' is not served by torchpool {only}")


# -- inputs and outputs -------------------------------------------------------

def _normalize_tensors(entries: list[TensorEntry], kind: str, max_batch_size: int) -> None:
    """Validate `input` or `output` entries (of `kind`), filling Triton's per-tensor defaults."""
    if not entries:
        fail("", f"model configuration must contain at least one {kind}, none were specified.")
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        path = f"{kind}[{index}]"
        _check_tensor(entry, kind, path, max_batch_size)
        if entry["name"] in seen:
            fail(f"{path}.name", f"{kind} '{entry['name']}' is specified more than once")
        seen.add(entry["name"])
        defaults: TensorEntry = (
            {"format": "FORMAT_NONE", "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False}
            if kind == "input" else {"label_filename": "", "is_shape_tensor": False})
        entries[index] = _with_defaults(entry, defaults)


def _with_defaults(entry: TensorEntry, defaults: TensorEntry) -> TensorEntry:
    """`entry` with missing fields filled, keeping the fields as written first."""
    return cast(TensorEntry, {**entry, **{k: v for k, v in defaults.items() if k not in entry}})


def _check_tensor(entry: TensorEntry, kind: str, path: str, max_batch_size: int) -> None:
    what = f"model {kind}"
    name = entry.get("name", "")
    if not name:
        fail(f"{path}.name", f"{what} must specify 'name'")
    what = f"{what} '{name}'"
    data_type = entry.get("data_type", "TYPE_INVALID")
    if data_type == "TYPE_INVALID":
        fail(f"{path}.data_type", f"{what} must specify 'data_type'")
    dims = entry.get("dims", [])
    if not dims:
        fail(f"{path}.dims", f"{what} must specify 'dims'")
    _check_dims(dims, f"{path}.dims", f"{what} dimension")
    _check_reshape(entry, dims, path, what, max_batch_size)
    if kind == "input":
        _check_format(entry, dims, path, what)


def _check_dims(dims: list[int], path: str, what: str) -> None:
    for dim in dims:
        if dim < 1 and dim != WILDCARD_DIM:
            fail(path, f"{what} must be integer >= 1, or -1 to indicate a variable-size dimension, got {dim}")


def _check_reshape(entry: TensorEntry, dims: list[int], path: str, what: str,
                   max_batch_size: int) -> None:
    """Triton's rule: same element count, compared between -1 dimensions."""
    if "reshape" not in entry:
        return
    shape = entry["reshape"].get("shape", [])
    entry["reshape"] = {"shape": shape}
    path = f"{path}.reshape"
    if not shape and max_batch_size == 0:
        fail(path, f"{what} cannot have empty reshape for non-batching model")
    _check_dims(shape, f"{path}.shape", f"{what} reshape dimension")
    if not shape and _element_counts(dims) == [1]:
        return                          # [1] -> [] makes a scalar per batch item
    if _element_counts(dims) != _element_counts(shape):
        fail(path, f"{what} has different size for dims {dims} and reshape {shape}")


def _element_counts(dims: list[int]) -> list[int]:
    """Element counts of the runs between variable-size (-1) dimensions."""
    counts = [1]
    for dim in dims:
        if dim == WILDCARD_DIM:
            counts.append(1)
        else:
            counts[-1] *= dim
    return counts


def _check_format(entry: TensorEntry, dims: list[int], path: str, what: str) -> None:
    fmt = entry.get("format", "FORMAT_NONE")
    if fmt != "FORMAT_NONE" and len(dims) != 3:
        fail(f"{path}.format", f"{what} NHWC/NCHW require 3 dims")


# -- batch inputs and outputs -------------------------------------------------

def _normalize_batch_inputs(cfg: RawConfig, input_names: list[str]) -> list[BatchInput]:
    names = set(input_names)
    out = []
    for index, given in enumerate(cfg.get("batch_input", [])):
        path = f"batch_input[{index}]"
        entry: BatchInput = {"kind": BATCH_INPUT_KIND_ENUM[0], "target_name": [], "source_input": [], **given}
        kind = entry["kind"]
        if not entry["target_name"]:
            fail(f"{path}.target_name", "batch input must specify 'target_name'")
        if entry.get("data_type") not in BATCH_INPUT_DATA_TYPES:
            fail(f"{path}.data_type", "batch input data type must be TYPE_INT32 or TYPE_FP32")
        _check_sources(entry["source_input"], names, path, f"batch input kind '{kind}'")
        out.append(entry)
    return out


def _normalize_batch_outputs(cfg: RawConfig, input_names: list[str],
                             output_names: list[str]) -> list[BatchOutput]:
    out = []
    for index, given in enumerate(cfg.get("batch_output", [])):
        path = f"batch_output[{index}]"
        entry: BatchOutput = {"kind": BATCH_OUTPUT_KIND_ENUM[0], "target_name": [], "source_input": [], **given}
        kind = entry["kind"]
        _check_sources(entry["source_input"], input_names, path, f"batch output kind '{kind}'")
        targets = entry["target_name"]
        for target in targets:
            if target not in output_names:
                fail(f"{path}.target_name", f"unknown target output name '{target}'")
        if len(set(targets)) != len(targets):
            fail(f"{path}.target_name", "a target output name can only be specified once")
        out.append(entry)
    return out


def _check_sources(sources: list[str], names: Collection[str], path: str, what: str) -> None:
    if len(sources) != 1:
        fail(f"{path}.source_input", f"{what} expects 1 source input, got {len(sources)}")
    if sources[0] not in names:
        fail(f"{path}.source_input", f"unknown source input name '{sources[0]}'")


# -- instance groups and versions ---------------------------------------------

def _normalize_instance_groups(cfg: RawConfig, model: str, gpus: Sequence[int]) -> list[InstanceGroupEntry]:
    """Triton's naming: the implicit group is named after the model, an unnamed
    explicit group `<model>_<index>`; a count of 0 (proto3 "unset") means 1.
    As in Triton, KIND_AUTO is resolved here (KIND_GPU where a GPU is visible,
    else KIND_CPU) and a KIND_GPU group without `gpus` gets every visible one,
    so `model_config` shows where the instances run; the supervisor places
    them by the same rule (its `instance_devices`)."""
    groups: list[InstanceGroupEntry] = cfg.get("instance_group") or [{"name": model}]
    out = []
    for index, given in enumerate(groups):
        path = f"instance_group[{index}]"
        group = cast(InstanceGroupEntry, {
            "name": given.get("name") or f"{model}_{index}", "kind": given.get("kind", "KIND_AUTO"),
            "count": given.get("count", 0), "gpus": given.get("gpus", []),
            **{k: v for k, v in given.items() if k not in ("name", "kind", "count", "gpus")}})
        label = f"instance group {group['name']} of model {model}"
        kind = group["kind"]
        if kind == "KIND_AUTO":
            group["kind"] = "KIND_GPU" if gpus else "KIND_CPU"
            kind = f"KIND_AUTO ({group['kind']} on this host: {'a' if gpus else 'no'} GPU is visible)"
        if group["kind"] == "KIND_GPU" and not group["gpus"]:
            group["gpus"] = list(gpus)
        if group["count"] < 0:
            fail(f"{path}.count", f"{label} must specify 'count' >= 1, got {group['count']}")
        group["count"] = group["count"] or 1
        if any(gpu < 0 for gpu in group["gpus"]):
            fail(f"{path}.gpus", f"{label} lists a negative GPU id: {group['gpus']}")
        if group["gpus"] and group["kind"] in ("KIND_CPU", "KIND_MODEL"):
            fail(f"{path}.gpus", f"{label} has kind {kind} but specifies one or more GPUs")
        out.append(group)
    return out


def _normalize_version_policy(policy: Optional[VersionPolicy]) -> VersionPolicy:
    """Exactly one of latest / all / specific; none at all means latest 1."""
    if not policy:
        return {"latest": {"num_versions": 1}}
    chosen = [k for k in VERSION_POLICIES if k in policy]     # the schema allows no other key
    if len(chosen) != 1:
        fail("version_policy", f"must set exactly one of 'latest', 'all' or 'specific', got {' and '.join(chosen)}")
    choice = chosen[0]
    if choice == "all":
        return {"all": {}}
    if choice == "latest":
        num = policy["latest"].get("num_versions", 0)
        if num < 1:
            fail("version_policy.latest.num_versions", f"must be >= 1, got {num}")
        return {"latest": {"num_versions": num}}
    versions = policy["specific"].get("versions", [])
    if not versions:
        fail("version_policy.specific.versions", "must list at least one version")
    if min(versions) < 1:
        fail("version_policy.specific.versions", f"versions must be >= 1, got {min(versions)}")
    return {"specific": {"versions": sorted(set(versions))}}


# -- schedulers ---------------------------------------------------------------

_QUEUE_POLICY_DEFAULTS: QueuePolicy = {
    "timeout_action": "REJECT", "default_timeout_microseconds": 0,
    "allow_timeout_override": False, "max_queue_size": 0,
}


def _queue_policy(policy: Optional[QueuePolicy]) -> QueuePolicy:
    return {**_QUEUE_POLICY_DEFAULTS, **(policy or {})}


def _normalize_dynamic_batching(cfg: RawConfig, max_batch_size: int) -> None:
    """Triton's defaults and checks; no preferred size means max_batch_size."""
    if "dynamic_batching" not in cfg:
        return
    name = cfg["name"]
    path = "dynamic_batching"
    db: DynamicBatching = {
        "preferred_batch_size": [], "max_queue_delay_microseconds": 0, "preserve_ordering": False,
        "priority_levels": 0, "default_priority_level": 0, **cfg["dynamic_batching"]}
    if not db["preferred_batch_size"] and max_batch_size > 0:
        db["preferred_batch_size"] = [max_batch_size]
    for size in db["preferred_batch_size"]:
        if size <= 0:
            fail(f"{path}.preferred_batch_size", f"dynamic batching preferred size must be positive for {name}")
        if size > max_batch_size:
            fail(f"{path}.preferred_batch_size",
                 f"dynamic batching preferred size must be <= max batch size for {name}")
    db["default_queue_policy"] = _queue_policy(db.get("default_queue_policy"))
    db["priority_queue_policy"] = {
        level: _queue_policy(policy) for level, policy in db.get("priority_queue_policy", {}).items()}
    _check_priorities(db, name, path)
    cfg["dynamic_batching"] = db


def _check_priorities(db: DynamicBatching, name: str, path: str) -> None:
    levels = db["priority_levels"]
    if levels:
        if not 1 <= db["default_priority_level"] <= levels:
            fail(f"{path}.default_priority_level", f"default priority level must be in range [1, {levels}] for {name}")
        for level in db["priority_queue_policy"]:
            if not 1 <= int(level) <= levels:
                fail(f"{path}.priority_queue_policy",
                     f"priority queue policy must have priority level in range [1, {levels}] for {name}")
    if db["preserve_ordering"]:
        if levels > 1:
            fail(f"{path}.preserve_ordering",
                 f"Only one priority level is allowed when 'preserve_ordering' is true for {name}")
        policies = [db["default_queue_policy"], *db["priority_queue_policy"].values()]
        if any(p["default_timeout_microseconds"] and p["timeout_action"] == "DELAY" for p in policies):
            fail(f"{path}.preserve_ordering",
                 f"Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for {name}")


def _normalize_sequence_batching(cfg: RawConfig, max_batch_size: int) -> None:
    """Light checks only (the sequence batcher validates its controls); fills
    Triton's 1 s idle default and the oldest strategy's preferred size."""
    if "sequence_batching" not in cfg:
        return
    path = "sequence_batching"
    sb: SequenceBatching = {"control_input": [], "state": [], **cfg["sequence_batching"]}
    if "direct" in sb and "oldest" in sb:
        fail(path, "must set at most one of 'direct' or 'oldest'")
    if not sb.get("max_sequence_idle_microseconds"):
        sb["max_sequence_idle_microseconds"] = SEQUENCE_IDLE_DEFAULT_MICROSECONDS
    if "oldest" in sb and not sb["oldest"].get("preferred_batch_size") and max_batch_size > 0:
        sb["oldest"] = {**sb["oldest"], "preferred_batch_size": [max_batch_size]}
    for index, control in enumerate(sb["control_input"]):
        if not control.get("name"):
            fail(f"{path}.control_input[{index}].name",
                 f"sequence batching control tensor must have a name for {cfg['name']}")
    cfg["sequence_batching"] = sb

