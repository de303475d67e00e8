"""Wire protocol: message schema, encoding, datatypes and error codes."""
from .errors import InferenceError, TorchpoolError

__all__ = ["InferenceError", "TorchpoolError"]
