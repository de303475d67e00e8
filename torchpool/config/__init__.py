"""Model repository and configuration: `config.pbtxt` / `config.json` parsing
(strict: Triton's model_config fields only), Triton's validation rules and
defaults, warmup samples, version directories."""
from .errors import ConfigError
from .model_config import InstanceGroup, ModelConfig, SequenceState, TensorSpec
from .pbtxt import parse_pbtxt
from .repository import ModelEntry, load_model_entry, scan_repository
from .warmup import WarmupInput, WarmupSample

__all__ = [
    "ConfigError", "ModelConfig", "SequenceState", "TensorSpec", "InstanceGroup", "ModelEntry",
    "WarmupSample", "WarmupInput", "parse_pbtxt", "scan_repository", "load_model_entry",
]
