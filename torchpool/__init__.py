"""torchpool: serve PyTorch models (TorchScript, torch.export, AOTInductor) like
Triton's PyTorch backend, from a pool of worker processes with a shared-memory
data path. This package imports the client only (no torch)."""
from .client import (AsyncClient, Classification, Client, InferenceError, InferResult, MultiClient,
                     NoAnswer, OutputRef, RawTensor, RegionOutput, SharedMemoryRef)

__version__ = "0.2.0"
__all__ = ["AsyncClient", "Classification", "Client", "InferResult", "InferenceError", "MultiClient",
           "NoAnswer", "OutputRef", "RawTensor", "RegionOutput", "SharedMemoryRef", "__version__"]
