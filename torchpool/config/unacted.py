"""Fields of Triton's model configuration that torchpool accepts and does not act on.

A Triton user's `config.pbtxt` loads unchanged, so every field of Triton's
schema is accepted (conform.py checks its type). Some mean nothing to
torchpool; a model that sets one loads, and the daemon logs one warning
for the model naming each such field and what it would have done in
Triton, so nobody believes a response cache or a rate limiter is there.
"""
from __future__ import annotations

from typing import Mapping, Optional

# top-level field -> what it does in Triton, that torchpool does not
_TOP = {
    "response_cache": "Triton's response cache",
    "optimization": "Triton's optimization policy (graph level, priority, CUDA graphs, pinned "
                    "memory, accelerators, eager batching)",
    "model_metrics": "Triton's per-model histogram buckets",
    "metric_tags": "extra metric labels",
    "model_transaction_policy": "Triton's decoupled responses (torchpool answers each request once)",
    "model_repository_agents": "Triton's repository agents",
    "model_operations": "Triton's custom-op libraries (torchpool's: parameter TORCHPOOL_OP_LIBRARIES)",
    "cc_model_filenames": "per-compute-capability model files",
    "runtime": "Triton's backend runtime choice",
}
# instance_group field -> what it does in Triton
_GROUP = {
    "rate_limiter": "Triton's rate limiter",
    "profile": "TensorRT optimization profiles",
    "passive": "passive instances",
    "host_policy": "Triton's host policies",
    "secondary_devices": "secondary devices",
}


def _set(value: object) -> bool:
    """Does the config give this field a value that would do something?"""
    if isinstance(value, dict):
        return any(_set(v) for v in value.values())
    if isinstance(value, list):
        return any(_set(v) for v in value)
    return value not in (None, False, 0, "", "0", "PRIORITY_DEFAULT")


def unacted_fields(raw: Mapping[str, object]) -> list[str]:
    """'field (what it does in Triton)' for each such field `raw` sets."""
    found = [f"{key} ({what})" for key, what in _TOP.items() if _set(raw.get(key))]
    groups = raw.get("instance_group")
    for i, group in enumerate(groups if isinstance(groups, list) else []):
        if isinstance(group, dict):
            found += [f"instance_group[{i}].{key} ({what})" for key, what in _GROUP.items()
                      if _set(group.get(key))]
    return found


def unacted_warning(name: str, raw: Mapping[str, object]) -> Optional[str]:
    """The one warning for a model that sets such fields, or None."""
    fields = unacted_fields(raw)
    if not fields:
        return None
    return (f"model '{name}': torchpool accepts and ignores these configuration fields: "
            f"{'; '.join(fields)}")
