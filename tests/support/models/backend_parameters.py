"""The backend's parameters: accepted, and kept per model.

forward(x) -> (INFERENCE_MODE, GRAD_ENABLED), both BOOL [1]:
INFERENCE_MODE = torch.zeros_like(x).is_inference() (true exactly when
forward runs under torch.inference_mode()), GRAD_ENABLED =
torch.is_grad_enabled() (false under both inference_mode and no_grad).
Input INPUT__0 FP32 [1], mbs 0, any value. Thread counts, optimized execution
and cuDNN are not observable from TorchScript in torch 2.13
(torch.get_num_threads / get_num_interop_threads / is_inference_mode_enabled
do not script), so only the parameters' acceptance is tested for them.
  params          INFERENCE_MODE "Off", INTRA_OP_THREAD_COUNT "1",
                  INTER_OP_THREAD_COUNT "1", DISABLE_OPTIMIZED_EXECUTION
                  "true", ENABLE_CACHE_CLEANING "0", DISABLE_CUDNN "TRUE"
                  -> loads; INFERENCE_MODE = [False], GRAD_ENABLED = [False].
  params_default  no parameters -> INFERENCE_MODE = [True],
                  GRAD_ENABLED = [False]. Loaded beside `params`, each keeps
                  its own setting (no leak between models).
"""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import torch
from torch import Tensor, nn

from .core import config, parameters, serialize, tensor, write_model_dir


class Params(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        # A tensor made here is an inference tensor only under inference_mode.
        inference = torch.zeros_like(x).is_inference()
        return torch.tensor([inference]), torch.tensor([torch.is_grad_enabled()])


READY: dict[str, tuple[int, ...]] = {"params": (1,), "params_default": (1,)}


def write_backend_parameters(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    params = serialize(Params())
    params_io = dict(inputs=[tensor("INPUT__0", "FP32", [1])],
                     outputs=[tensor("INFERENCE_MODE", "BOOL", [1]),
                              tensor("GRAD_ENABLED", "BOOL", [1])],
                     max_batch_size=0)
    write_model_dir(root, "params",
                    config("params", **params_io, comment="every parameter set",
                           extra=parameters(INFERENCE_MODE="Off", INTRA_OP_THREAD_COUNT="1",
                                            INTER_OP_THREAD_COUNT="1",
                                            DISABLE_OPTIMIZED_EXECUTION="true",
                                            ENABLE_CACHE_CLEANING="0", DISABLE_CUDNN="TRUE")),
                    params)
    write_model_dir(root, "params_default", config("params_default", **params_io, comment="no parameters"),
                    params)
