"""Model repository and configuration: `config.pbtxt` / `config.json` parsing,
Triton's validation rules and defaults, version directories."""
from .model_config import ConfigError, InstanceGroup, ModelConfig, SequenceState, TensorSpec
from .pbtxt import parse_pbtxt
from .repository import ModelEntry, load_model_entry, scan_repository

__all__ = [
    "ConfigError", "ModelConfig", "SequenceState", "TensorSpec", "InstanceGroup", "ModelEntry",
    "parse_pbtxt", "scan_repository", "load_model_entry",
]
