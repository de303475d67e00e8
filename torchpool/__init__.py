"""torchpool: serve TorchScript models like Triton's PyTorch backend, from a
pool of worker processes with a shared-memory data path."""
from .client import AsyncClient, Client
from .client_shm import InferResult, OutputRef, RegionOutput, SharedMemoryRef
from .protocol.errors import InferenceError

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "InferResult", "InferenceError", "OutputRef", "RegionOutput",
           "SharedMemoryRef", "__version__"]
