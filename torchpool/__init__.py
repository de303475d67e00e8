"""torchpool: serve TorchScript models like Triton's PyTorch backend, from a
pool of worker processes with a shared-memory data path."""
from .client import (AsyncClient, Classification, Client, InferenceError, InferResult, OutputRef,
                     RegionOutput, SharedMemoryRef)

__version__ = "0.2.0"
__all__ = ["AsyncClient", "Classification", "Client", "InferResult", "InferenceError", "OutputRef",
           "RegionOutput", "SharedMemoryRef", "__version__"]
