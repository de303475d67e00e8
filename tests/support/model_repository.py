"""A Triton-style model repository that exercises every PyTorch-backend rule.

`build_test_repository(root)` writes the models below under `root` (a small
fraction of a second once torch is imported). End-to-end tests start the real server on it.
`python tests/model_repository.py DIR` builds the repository in DIR and runs a
self-check that loads every model.pt in-process and checks what is listed here.

Conventions used in this list
-----------------------------
* `mbs` is `max_batch_size`. With mbs > 0 every input and output has an
  implicit leading batch dimension: a request of n items sends `[n] + dims`
  and gets `[n] + dims` back. With mbs 0 the shape is exactly `dims`.
* `-1` in dims means any size. Every model has exactly version 1 unless said.
* Every config uses `platform: "pytorch_libtorch"` except those marked
  [backend], which say `backend: "pytorch"` (and no platform); both must load.
* No model has `dynamic_batching` unless said: such a model executes every
  request on its own (Triton's default scheduler), so an error in one request
  never touches another.
* Expected error texts are Triton's wording; the server's message must
  *contain* the quoted text (it may add a prefix such as the model name).
  `<root>` is the directory passed to `build_test_repository` (absolute).
* `EXPECTED_READY` and `expected_load_errors(root)` at the bottom of this
  module hold the load expectations as data.

Add/sub models in Triton's QA style (pure functions, version 1 only)
--------------------------------------------------------------------------
forward(input0, input1) -> (input0 + input1, input0 - input1).
  libtorch_int8_int8_int8          INPUT__0, INPUT__1 INT8 [16], mbs 8 ->
                                   OUTPUT__0 = a + b, OUTPUT__1 = a - b (INT8;
                                   int8 wraps: keep values in [-60, 60]).
  libtorch_int16_int16_int16       [backend] INPUT0, INPUT1 INT16 [16], mbs 8 ->
                                   OUTPUT0 = a + b, OUTPUT1 = a - b (INT16).
  libtorch_int32_int32_int32       INPUT0, INPUT1 INT32 [16], mbs 8 ->
                                   OUTPUT0 = a + b, OUTPUT1 = a - b (INT32).
  libtorch_float32_float32_float32 INPUT__0, INPUT__1 FP32 [16], mbs 8 ->
                                   OUTPUT__0 = a + b, OUTPUT__1 = a - b (FP32).
  libtorch_nobatch_float32_float32_float32
                                   as libtorch_float32_float32_float32 but
                                   mbs 0: shapes are exactly [16].
  libtorch_json_config             config.json (Triton's JSON, int64 values as
                                   strings: "dims": ["16"]), no config.pbtxt.
                                   INPUT0, INPUT1 INT32 [16], mbs 8 ->
                                   OUTPUT0 = a + b, OUTPUT1 = a - b.
  custom_filename                  `default_model_filename: "weights.pt"`; the
                                   version dir holds only 1/weights.pt.
                                   INPUT__0, INPUT__1 FP32 [16], mbs 8 ->
                                   OUTPUT__0 = a + b, OUTPUT__1 = a - b.
  multi_instance                   instance_group [ { count: 2 kind: KIND_CPU } ]:
                                   two instances, same I/O as custom_filename.
  gpu_instance                     instance_group [ { count: 1 kind: KIND_GPU } ],
                                   same I/O as custom_filename. Without CUDA it
                                   FAILS to load (message mentions GPU); on a
                                   machine with CUDA it loads and computes the
                                   same, outputs on CPU for the client.
  identity_bf16                    INPUT__0 BF16 [-1], mbs 0 -> OUTPUT__0 =
                                   INPUT__0 (BF16). Triton rejects BF16; torch
                                   supports it, so torchpool should load it.

Versions and version policies (forward(x) -> x * v, v = the version number)
--------------------------------------------------------------------------
All: INPUT0 FP32 [4], mbs 8 -> OUTPUT0 FP32 [4] = INPUT0 * v. Version dirs
1, 2, 3 unless said. A request without a version gets the highest loaded one;
a request for a version that is not loaded fails.
  versioned                 default policy (latest 1)          -> ready: 3
  versioned_latest_2        latest { num_versions: 2 }          -> ready: 2, 3
  versioned_all             all { }                             -> ready: 1, 2, 3
  versioned_specific_1_3    specific { versions: [ 1, 3 ] }     -> ready: 1, 3
  versioned_numeric_order   dirs 2/, 10/ and notes/ (not a number: ignored),
                            default policy -> ready: 10 (10 > 2 numerically;
                            a string sort would pick 2).

Naming conventions (binding config inputs to forward arguments)
---------------------------------------------------------------
All FP32 dims [4], mbs 8. A wrong binding changes the sign or swaps outputs.
  naming_forward_argument  forward(b, a) -> a - b. Config lists input `a`, then
                           `b` (FORWARD_ARGUMENT: bound by argument name).
                           OUTPUT__0 = a - b.
  naming_named_index       forward(x, y) -> (x - y, x * y). Config lists
                           INPUT__1 before INPUT__0 and OUTPUT__1 before
                           OUTPUT__0 (NAMED_INDEX). OUTPUT__0 = INPUT__0 -
                           INPUT__1, OUTPUT__1 = INPUT__0 * INPUT__1.
  naming_strict            forward(x, y) -> (x - y, x * y). Config inputs ZETA,
                           ALPHA and outputs SUB, MUL in that order
                           (STRICT_CONFIG_ORDERING; an alphabetical sort would
                           swap both). SUB = ZETA - ALPHA, MUL = ZETA * ALPHA.
  naming_bad_suffix        forward(x, y) -> (x - y, x * y). Config inputs
                           INPUT__1, then INPUT__a: `a` is not an integer, so
                           STRICT ordering (a warning is logged) binds
                           INPUT__1 -> x, INPUT__a -> y. Outputs (NAMED_INDEX):
                           OUTPUT__0 = INPUT__1 - INPUT__a,
                           OUTPUT__1 = INPUT__1 * INPUT__a.
  dict_input               forward(inputs: Dict[str, Tensor]) ->
                           inputs["x"] * 2 + inputs["y"]. Config lists `y`
                           before `x` (the names are the keys; order is
                           irrelevant). OUTPUT__0 = x * 2 + y.
  all_dtypes               forward(BOOL, UINT8, INT8, INT16, INT32, INT64,
                           FP16, FP32, FP64) returns each argument unchanged.
                           Inputs named exactly so (FORWARD_ARGUMENT), each of
                           that TYPE_ with dims [-1], mbs 0. Outputs BOOL_OUT,
                           UINT8_OUT, ... FP64_OUT (STRICT order, same types):
                           X_OUT == X bit for bit.

Strings (TYPE_STRING <-> TorchScript List[str]; use ASCII: TorchScript
reverses bytes, which would break multi-byte UTF-8 characters)
--------------------------------------------------------------------------
forward(text: List[str]) -> (reversed strings, lengths as INT64 tensor).
  string_io       mbs 0. INPUT__0 STRING [-1] -> OUTPUT__0 STRING [-1] = each
                  string reversed, OUTPUT__1 INT64 [-1] = each string's length
                  in bytes. ["abc", "", "hello"] -> ["cba", "", "olleh"],
                  [3, 0, 5]. An empty list gives [] and an empty INT64 [0].
  string_batched  mbs 8, dynamic_batching { max_queue_delay_microseconds:
                  50000 }. INPUT__0 STRING dims [1] reshape { shape: [ ] }
                  (the model sees one flat List[str] of the whole batch;
                  this is how Triton accepts batched strings: 0 dims + batch
                  = 1-D). OUTPUT__0 STRING dims [1] reshape [ ] and OUTPUT__1
                  INT64 dims [1] reshape [ ], same functions. A request sends
                  [n, 1] and gets its own n results back, shape [n, 1] per the
                  config (Triton's C++ backend answers [n] for the string
                  output; compare values flattened). Concurrent requests get
                  batched together: each must get exactly its own strings.

Shapes, batching and reshape
----------------------------
  identity_fp32    [backend] INPUT__0 FP32 [-1], mbs 0 -> OUTPUT__0 = INPUT__0.
                   Zero-size ([0]) and any-length inputs must round-trip.
  identity_batched INPUT__0 FP32 [-1, 3], mbs 4 -> OUTPUT__0 = INPUT__0, shape
                   [n, k, 3] with n <= 4; n = 5 must be rejected (batch size
                   above max_batch_size 4).
  input_views      INPUT__0 FP32 [-1], mbs 0 -> OUTPUT__0 = INPUT__0 (the input
                   itself), OUTPUT__1 = INPUT__0[8:] (a contiguous view into it),
                   OUTPUT__2 = INPUT__0[::2] (a strided view), all FP32 [-1]:
                   which outputs may come back in a local client's own input block.
  reshape_model    mbs 0. INPUT__0 FP32 dims [2, 6] reshape { shape: [3, 4] }.
                   OUTPUT__0 INT64 dims [2] = the shape the model saw: [3, 4].
                   OUTPUT__1 FP32 dims [4, 3] reshape { shape: [12] }: the
                   model returns x.flatten() ([12]), the client gets [4, 3] =
                   the input's 12 values in row-major order.
  reshape_batched  mbs 4. INPUT__0 FP32 dims [2, 6] reshape { shape: [3, 4] }.
                   OUTPUT__0 INT64 dims [3]: every row = the shape the model
                   saw = [n, 3, 4] for a request of n items.
  reshape_variable mbs 4. INPUT__0 FP32 dims [-1, 6] reshape { shape: [-1, 2, 3] }
                   (Triton resolves the reshape's -1 from the request).
                   OUTPUT__0 INT64 dims [4]: every row = the shape the model
                   saw = [n, k, 2, 3] for a request of shape [n, k, 6].
  batch_probe      mbs 8, dynamic_batching { max_queue_delay_microseconds:
                   100000 }. INPUT__0 FP32 [1] -> OUTPUT__0 INT64 [1] = the
                   batch size of the execution this row was part of (same for
                   every row of one execution; never above 8), OUTPUT__1 FP32
                   [1] = INPUT__0 (so each request can check it got its own
                   rows back). One lone request waits up to 0.1 s.

Parameters
----------
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

Execution errors and slow models (all load fine)
------------------------------------------------
  raise_on_negative  INPUT__0 FP32 [4], mbs 8 -> OUTPUT__0 = INPUT__0; if the
                     sum of the whole input is < 0 forward raises
                     RuntimeError("boom: input sum is negative"): that request
                     fails with "PyTorch execute failure: " and the text
                     contains "boom: input sum is negative"; other requests
                     (before and after) succeed.
  bad_output_index   INPUT__0, INPUT__1 FP32 [4], mbs 8; config outputs
                     OUTPUT__0, OUTPUT__1, OUTPUT__2 (FP32 [4]); forward
                     returns 2 tensors -> every request fails: "The output
                     OUTPUT__2 in the model configuration refers to an output
                     index which doesn't exist. This model has 2 outputs".
  bad_output_dtype   INPUT__0 FP32 [4], mbs 8, output OUTPUT__0 TYPE_INT32 [4];
                     forward returns the FP32 input -> every request fails:
                     "configuration expects datatype TYPE_INT32 for output
                     'OUTPUT__0', model provides TYPE_FP32".
  bad_scalar_output  INPUT__0 FP32 [4], mbs 0, output OUTPUT__0 FP32 [1];
                     forward returns x.sum() (0-dim) -> every request fails:
                     "output 'OUTPUT__0' is a scalar which is not supported."
  bad_list_tensor_output
                     INPUT__0 FP32 [4], mbs 0, output OUTPUT__0 FP32 [4];
                     forward returns [x, x] (List[Tensor]) -> every request
                     fails: "PyTorch execute failure: output must be of type
                     Tensor or List[str], received List[Tensor]".
  slow               INPUT__0 INT64 [1], mbs 0 -> OUTPUT__0 INT64 [1] =
                     INPUT__0: forward runs INPUT__0 iterations of a tiny
                     add (about 1 us each once warm; the first call is a few
                     times slower). `slow_iterations(seconds)` in this module
                     measures the count for a duration on this machine.
                     Other models keep answering while it runs.
  slow_x2            the same with instance_group count 2 (KIND_CPU): two
                     concurrent slow requests overlap.

Sequence and ragged batching
----------------------------
  sequence_accumulate  mbs 0, sequence_batching (direct,
                       max_sequence_idle_microseconds 5000000).
                       INPUT__0 INT32 [1]; control START__1
                       (CONTROL_SEQUENCE_START, int32_false_true [0, 1]);
                       implicit state STATE_IN__2 / STATE_OUT__1 INT32 [1]
                       (zero initial state). forward(x, start, state) ->
                       (total, total) with total = state * (1 - start) + x.
                       OUTPUT__0 INT32 [1] = running sum of the sequence's
                       inputs: sequence A sending 1, 2, 3 gets 1, 3, 6 while
                       an interleaved sequence B sending 10, 20 gets 10, 30.
                       STATE_OUT__1 is never sent to the client.
  ragged_sum           mbs 8, INPUT__0 FP32 [-1] allow_ragged_batch: true,
                       batch_input BATCH_ACCUMULATED_ELEMENT_COUNT (target
                       INDEX__1, TYPE_INT32, source INPUT__0), output
                       OUTPUT__0 FP32 [1], dynamic_batching {
                       max_queue_delay_microseconds: 50000 }. A request sends
                       [1, k] and gets [1, 1] = the sum of its k values, also
                       when requests of different k are batched together.
                       The model gets INPUT__0 as one flat concatenation and
                       INDEX__1 = end offsets (any shape; it is flattened).

Models that must FAIL to load (the server keeps serving all the others)
-----------------------------------------------------------------------
  broken_missing_file   valid config, empty 1/: "unable to find
                        'broken_missing_file/1/model.pt' for model
                        instance 'broken_missing_file'" (Triton puts the model
                        name where the message says instance).
  broken_arg_count      config inputs INPUT__0, INPUT__1; forward(x):
                        "unable to load model 'broken_arg_count', configuration
                        expects 2 inputs, model provides 1".
  broken_arg_type       forward(x: Tensor, n: int): "An input of type 'int' was
                        detected in the model. Only a single input of type
                        Dict(str, Tensor) or input(s) of type Tensor are
                        supported."
  broken_two_dicts      forward(a: Dict[str, Tensor], b: Dict[str, Tensor]):
                        "Multiple inputs of kind DictType were detected. Only a
                        single input of type Dict(str, Tensor) is supported."
  broken_string_2d      mbs 8 with a TYPE_STRING input of dims [-1] (2-D with
                        the batch dim): "Triton only supports 1 dimensional
                        List of String as input for 'INPUT__0' for model
                        'broken_string_2d'".
  broken_bool_param     parameters INFERENCE_MODE "maybe": "failed to convert
                        'maybe' to boolean".
  broken_pbtxt_syntax   config.pbtxt is not valid protobuf text (an input
                        block is never closed); the message names the config
                        file (exact text is the parser's).
  broken_platform_onnx  platform: "onnxruntime_onnx" (1/model.pt is a valid
                        TorchScript file); the message names the platform.
  broken_no_config      1/model.pt but no config.pbtxt / config.json: never
                        READY (absent from the index or UNAVAILABLE, the
                        message saying the config is missing).
  broken_corrupt_model  1/model.pt holds random bytes: "failed to load model
                        'broken_corrupt_model': PytorchStreamReader failed
                        reading zip archive".
  gpu_instance          (see above) fails only where CUDA is unavailable.
"""
from __future__ import annotations

import functools
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn


# --- TorchScript modules -------------------------------------------------------
# Each is scripted once and its bytes written wherever it is needed.

class AddSub(nn.Module):
    def forward(self, input0: Tensor, input1: Tensor) -> Tuple[Tensor, Tensor]:
        return input0 + input1, input0 - input1


class Scale(nn.Module):
    """x * version: each version's outputs can be told apart."""

    def __init__(self, factor: int = 1) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


class ForwardArgs(nn.Module):
    # Arguments deliberately in the opposite order of the config inputs.
    def forward(self, b: Tensor, a: Tensor) -> Tensor:
        return a - b


class SubMul(nn.Module):
    # Antisymmetric first output (shows swapped inputs), distinct second
    # output (shows swapped outputs).
    def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        return x - y, x * y


class DictInput(nn.Module):
    def forward(self, inputs: Dict[str, Tensor]) -> Tensor:
        return inputs["x"] * 2 + inputs["y"]


class AllDtypes(nn.Module):
    def forward(self, BOOL: Tensor, UINT8: Tensor, INT8: Tensor, INT16: Tensor,
                INT32: Tensor, INT64: Tensor, FP16: Tensor, FP32: Tensor,
                FP64: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                       Tensor, Tensor, Tensor, Tensor]:
        return BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, FP32, FP64


class ReverseStrings(nn.Module):
    def forward(self, text: List[str]) -> Tuple[List[str], Tensor]:
        reversed_text: List[str] = []
        lengths: List[int] = []
        for s in text:
            reversed_text.append(s[::-1])
            lengths.append(len(s))
        return reversed_text, torch.tensor(lengths, dtype=torch.int64)


class UpperStrings(nn.Module):
    def forward(self, text: List[str]) -> List[str]:
        return [s.upper() for s in text]


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class InputViews(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return x, x[8:], x[::2]


class ShapeAndFlat(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return torch.tensor(x.size(), dtype=torch.int64), x.flatten()


class ShapePerRow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        shape = torch.tensor(x.size(), dtype=torch.int64)
        return shape.unsqueeze(0).repeat(x.size(0), 1)


class BatchProbe(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        batch = x.size(0)
        return torch.full([batch, 1], batch, dtype=torch.int64), x


class Params(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        # A tensor made here is an inference tensor only under inference_mode.
        inference = torch.zeros_like(x).is_inference()
        return torch.tensor([inference]), torch.tensor([torch.is_grad_enabled()])


class RaiseOnNegative(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if bool(x.sum() < 0):
            raise RuntimeError("boom: input sum is negative")
        return x


class Scalar(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sum()


class ListOfTensors(nn.Module):
    def forward(self, x: Tensor) -> List[Tensor]:
        return [x, x]


class Slow(nn.Module):
    """Busy loop: TorchScript has no clock or sleep, so work stands in for time."""

    def forward(self, iterations: Tensor) -> Tensor:
        n = int(iterations.reshape([-1])[0])
        count = torch.zeros([1], dtype=torch.int64)
        for _ in range(n):
            count = count + 1
        return count


class SequenceAccumulate(nn.Module):
    def forward(self, x: Tensor, start: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
        total = state * (1 - start) + x
        return total, total


class RaggedSum(nn.Module):
    def forward(self, data: Tensor, ends: Tensor) -> Tensor:
        flat = data.flatten()
        offsets = ends.flatten().to(torch.int64)
        sums: List[Tensor] = []
        begin = 0
        for i in range(offsets.size(0)):
            end = int(offsets[i])
            sums.append(flat[begin:end].sum().reshape([1]))
            begin = end
        return torch.stack(sums)


class OneArg(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class IntArg(nn.Module):
    def forward(self, x: Tensor, n: int) -> Tensor:
        return x * n


class TwoDicts(nn.Module):
    def forward(self, a: Dict[str, Tensor], b: Dict[str, Tensor]) -> Tensor:
        return a["x"] + b["x"]


# --- config text -----------------------------------------------------------------

def _dims(dims: Sequence[int]) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]" if dims else "[ ]"


def tensor(name: str, data_type: str, dims: Sequence[int], *,
           reshape: Optional[Sequence[int]] = None, comment: str = "",
           extra: str = "") -> str:
    """One `input`/`output` entry; `data_type` without the TYPE_ prefix."""
    lines = [f'    name: "{name}"' + (f"  # {comment}" if comment else ""),
             f"    data_type: TYPE_{data_type}",
             f"    dims: {_dims(dims)}"]
    if reshape is not None:
        lines.append(f"    reshape: {{ shape: {_dims(reshape)} }}")
    if extra:
        lines.append(f"    {extra}")
    return "  {\n" + "\n".join(lines) + "\n  }"


def config(name: str, *, inputs: Sequence[str], outputs: Sequence[str],
           max_batch_size: int, comment: str = "", extra: str = "",
           backend: bool = False, platform: str = "pytorch_libtorch") -> str:
    header = f"# {comment}\n" if comment else ""
    runtime = 'backend: "pytorch"' if backend else f'platform: "{platform}"'
    return (f'{header}name: "{name}"\n{runtime}\nmax_batch_size: {max_batch_size}\n'
            "input [\n" + ",\n".join(inputs) + "\n]\n"
            "output [\n" + ",\n".join(outputs) + "\n]\n" + extra)


def parameters(**values: str) -> str:
    return "".join(f'parameters: {{\n  key: "{k}"\n  value: {{ string_value: "{v}" }}\n}}\n'
                   for k, v in values.items())


def instances(count: int, kind: str) -> str:
    return f"instance_group [\n  {{\n    count: {count}\n    kind: {kind}\n  }}\n]\n"


def dynamic_batching(delay_us: int) -> str:
    return f"dynamic_batching {{\n  max_queue_delay_microseconds: {delay_us}\n}}\n"


# --- writing ---------------------------------------------------------------------

def serialize(module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def _write(root: Path, name: str, *, config_text: Optional[str], model: Optional[bytes],
           versions: Sequence[int] = (1,), filename: str = "model.pt",
           config_file: str = "config.pbtxt") -> None:
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    if config_text is not None:
        (model_dir / config_file).write_text(config_text)
    for version in versions:
        version_dir = model_dir / str(version)
        version_dir.mkdir(exist_ok=True)
        if model is not None:
            (version_dir / filename).write_bytes(model)


class PlusOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + 1


def write_plus_one(root: Path, extra: str = "") -> None:
    """`plus_one` under `root`: INPUT__0 FP32 [-1] -> OUTPUT__0 = x + 1, mbs 0;
    `extra` is added to its config (e.g. `instances(2, "KIND_CPU")`)."""
    _write(root, "plus_one", config_text=config("plus_one", inputs=[tensor("INPUT__0", "FP32", [-1])],
                                                outputs=[tensor("OUTPUT__0", "FP32", [-1])],
                                                max_batch_size=0) + extra,
           model=serialize(PlusOne()))


def _addsub_io(dtype: str, named_index: bool, dims: Sequence[int] = (16,)
               ) -> tuple[list[str], list[str]]:
    i0, i1, o0, o1 = (("INPUT__0", "INPUT__1", "OUTPUT__0", "OUTPUT__1") if named_index
                      else ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"))
    inputs = [tensor(i0, dtype, dims), tensor(i1, dtype, dims)]
    outputs = [tensor(o0, dtype, dims, comment=f"{i0} + {i1}"),
               tensor(o1, dtype, dims, comment=f"{i0} - {i1}")]
    return inputs, outputs


def build_test_repository(root: Path) -> None:
    """Write every model described in this module's docstring under `root`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)

    addsub = serialize(AddSub())
    submul = serialize(SubMul())
    identity = serialize(Identity())
    reverse_strings = serialize(ReverseStrings())
    slow = serialize(Slow())
    params = serialize(Params())

    def write(name: str, config_text: Optional[str], model: Optional[bytes], **kw) -> None:
        _write(root, name, config_text=config_text, model=model, **kw)

    # Add/sub in Triton's QA style.
    for dtype, np_name, named_index, backend in [
            ("INT8", "int8", True, False), ("INT16", "int16", False, True),
            ("INT32", "int32", False, False), ("FP32", "float32", True, False)]:
        name = f"libtorch_{np_name}_{np_name}_{np_name}"
        inputs, outputs = _addsub_io(dtype, named_index)
        write(name, config(name, inputs=inputs, outputs=outputs, max_batch_size=8,
                           backend=backend, comment=f"{dtype} add/sub"), addsub)

    name = "libtorch_nobatch_float32_float32_float32"
    inputs, outputs = _addsub_io("FP32", True)
    write(name, config(name, inputs=inputs, outputs=outputs, max_batch_size=0,
                       comment="add/sub without batching: shapes are exactly [16]"), addsub)

    write("libtorch_json_config", json.dumps(_JSON_CONFIG, indent=2) + "\n", addsub,
          config_file="config.json")

    inputs, outputs = _addsub_io("FP32", True)
    write("custom_filename",
          config("custom_filename", inputs=inputs, outputs=outputs, max_batch_size=8,
                 comment="the model file is 1/weights.pt",
                 extra='default_model_filename: "weights.pt"\n'),
          addsub, filename="weights.pt")
    write("multi_instance",
          config("multi_instance", inputs=inputs, outputs=outputs, max_batch_size=8,
                 comment="two CPU instances", extra=instances(2, "KIND_CPU")),
          addsub)
    write("gpu_instance",
          config("gpu_instance", inputs=inputs, outputs=outputs, max_batch_size=8,
                 comment="loads only where CUDA is available",
                 extra=instances(1, "KIND_GPU")),
          addsub)
    write("identity_bf16",
          config("identity_bf16", inputs=[tensor("INPUT__0", "BF16", [-1])],
                 outputs=[tensor("OUTPUT__0", "BF16", [-1])], max_batch_size=0,
                 comment="BF16: Triton rejects it, torch supports it"),
          identity)

    # Versions and version policies.
    scale = torch.jit.script(Scale())
    scaled: dict[int, bytes] = {}
    for version in (1, 2, 3, 10):
        scale.factor = version
        buffer = io.BytesIO()
        torch.jit.save(scale, buffer)
        scaled[version] = buffer.getvalue()
    policies = {
        "versioned": "",
        "versioned_latest_2": "version_policy: { latest: { num_versions: 2 } }\n",
        "versioned_all": "version_policy: { all: { } }\n",
        "versioned_specific_1_3": "version_policy: { specific: { versions: [ 1, 3 ] } }\n",
        "versioned_numeric_order": "",
    }
    for name, policy in policies.items():
        versions = (2, 10) if name == "versioned_numeric_order" else (1, 2, 3)
        write(name, config(name, inputs=[tensor("INPUT0", "FP32", [4])],
                           outputs=[tensor("OUTPUT0", "FP32", [4], comment="INPUT0 * version")],
                           max_batch_size=8, extra=policy,
                           comment="version v returns INPUT0 * v"),
              None, versions=versions)
        for version in versions:
            (root / name / str(version) / "model.pt").write_bytes(scaled[version])
    notes = root / "versioned_numeric_order" / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "README.txt").write_text("Not a version directory: must be ignored.\n")

    # Naming conventions.
    f4 = functools.partial(tensor, data_type="FP32", dims=[4])
    write("naming_forward_argument",
          config("naming_forward_argument",
                 inputs=[f4("a"), f4("b")], outputs=[f4("OUTPUT__0", comment="a - b")],
                 max_batch_size=8,
                 comment="forward(self, b, a): inputs bind by argument name"),
          serialize(ForwardArgs()))
    write("naming_named_index",
          config("naming_named_index",
                 inputs=[f4("INPUT__1"), f4("INPUT__0")],
                 outputs=[f4("OUTPUT__1", comment="INPUT__0 * INPUT__1"),
                          f4("OUTPUT__0", comment="INPUT__0 - INPUT__1")],
                 max_batch_size=8, comment="<name>__<index>: the suffix is the position"),
          submul)
    write("naming_strict",
          config("naming_strict",
                 inputs=[f4("ZETA"), f4("ALPHA")],
                 outputs=[f4("SUB", comment="ZETA - ALPHA"), f4("MUL", comment="ZETA * ALPHA")],
                 max_batch_size=8, comment="no convention matches: config order is argument order"),
          submul)
    write("naming_bad_suffix",
          config("naming_bad_suffix",
                 inputs=[f4("INPUT__1"), f4("INPUT__a")],
                 outputs=[f4("OUTPUT__0", comment="INPUT__1 - INPUT__a"),
                          f4("OUTPUT__1", comment="INPUT__1 * INPUT__a")],
                 max_batch_size=8,
                 comment="'a' is not an index: inputs fall back to strict ordering"),
          submul)
    write("dict_input",
          config("dict_input", inputs=[f4("y"), f4("x")],
                 outputs=[f4("OUTPUT__0", comment="x * 2 + y")], max_batch_size=8,
                 comment="forward(self, inputs: Dict[str, Tensor]): names are the keys"),
          serialize(DictInput()))
    all_types = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]
    write("all_dtypes",
          config("all_dtypes", inputs=[tensor(t, t, [-1]) for t in all_types],
                 outputs=[tensor(f"{t}_OUT", t, [-1]) for t in all_types],
                 max_batch_size=0, comment="every Triton datatype, returned unchanged"),
          serialize(AllDtypes()))

    # Strings.
    write("string_io",
          config("string_io", inputs=[tensor("INPUT__0", "STRING", [-1])],
                 outputs=[tensor("OUTPUT__0", "STRING", [-1], comment="each string reversed"),
                          tensor("OUTPUT__1", "INT64", [-1], comment="each string's length")],
                 max_batch_size=0, comment="forward(self, text: List[str])"),
          reverse_strings)
    write("string_batched",
          config("string_batched",
                 inputs=[tensor("INPUT__0", "STRING", [1], reshape=[])],
                 outputs=[tensor("OUTPUT__0", "STRING", [1], reshape=[],
                                 comment="each string reversed"),
                          tensor("OUTPUT__1", "INT64", [1], reshape=[],
                                 comment="each string's length")],
                 max_batch_size=8, extra=dynamic_batching(50000),
                 comment="batched strings: dims [1] reshaped to [] keeps the list 1-D"),
          reverse_strings)

    # Shapes, batching and reshape.
    write("identity_fp32",
          config("identity_fp32", inputs=[tensor("INPUT__0", "FP32", [-1])],
                 outputs=[tensor("OUTPUT__0", "FP32", [-1])], max_batch_size=0,
                 backend=True, comment="any length, zero included"),
          identity)
    write("identity_batched",
          config("identity_batched", inputs=[tensor("INPUT__0", "FP32", [-1, 3])],
                 outputs=[tensor("OUTPUT__0", "FP32", [-1, 3])], max_batch_size=4),
          identity)
    write("input_views",
          config("input_views", inputs=[tensor("INPUT__0", "FP32", [-1])],
                 outputs=[tensor(f"OUTPUT__{i}", "FP32", [-1]) for i in range(3)], max_batch_size=0),
          serialize(InputViews()))
    write("reshape_model",
          config("reshape_model",
                 inputs=[tensor("INPUT__0", "FP32", [2, 6], reshape=[3, 4])],
                 outputs=[tensor("OUTPUT__0", "INT64", [2], comment="the shape forward saw"),
                          tensor("OUTPUT__1", "FP32", [4, 3], reshape=[12],
                                 comment="forward returns [12]")],
                 max_batch_size=0, comment="reshape on an input and on an output"),
          serialize(ShapeAndFlat()))
    write("reshape_batched",
          config("reshape_batched",
                 inputs=[tensor("INPUT__0", "FP32", [2, 6], reshape=[3, 4])],
                 outputs=[tensor("OUTPUT__0", "INT64", [3],
                                 comment="every row: the shape forward saw")],
                 max_batch_size=4),
          serialize(ShapePerRow()))
    write("reshape_variable",
          config("reshape_variable",
                 inputs=[tensor("INPUT__0", "FP32", [-1, 6], reshape=[-1, 2, 3])],
                 outputs=[tensor("OUTPUT__0", "INT64", [4],
                                 comment="every row: the shape forward saw")],
                 max_batch_size=4),
          serialize(ShapePerRow()))
    write("batch_probe",
          config("batch_probe", inputs=[tensor("INPUT__0", "FP32", [1])],
                 outputs=[tensor("OUTPUT__0", "INT64", [1], comment="executed batch size"),
                          tensor("OUTPUT__1", "FP32", [1], comment="INPUT__0")],
                 max_batch_size=8, extra=dynamic_batching(100000)),
          serialize(BatchProbe()))

    # Parameters.
    params_io = dict(inputs=[tensor("INPUT__0", "FP32", [1])],
                     outputs=[tensor("INFERENCE_MODE", "BOOL", [1]),
                              tensor("GRAD_ENABLED", "BOOL", [1])],
                     max_batch_size=0)
    write("params",
          config("params", **params_io, comment="every parameter set",
                 extra=parameters(INFERENCE_MODE="Off", INTRA_OP_THREAD_COUNT="1",
                                  INTER_OP_THREAD_COUNT="1",
                                  DISABLE_OPTIMIZED_EXECUTION="true",
                                  ENABLE_CACHE_CLEANING="0", DISABLE_CUDNN="TRUE")),
          params)
    write("params_default", config("params_default", **params_io, comment="no parameters"),
          params)

    # Execution errors and slow models.
    write("raise_on_negative",
          config("raise_on_negative", inputs=[f4("INPUT__0")], outputs=[f4("OUTPUT__0")],
                 max_batch_size=8, comment="forward raises when the input sum is negative"),
          serialize(RaiseOnNegative()))
    write("bad_output_index",
          config("bad_output_index", inputs=[f4("INPUT__0"), f4("INPUT__1")],
                 outputs=[f4("OUTPUT__0"), f4("OUTPUT__1"),
                          f4("OUTPUT__2", comment="the model has only 2 outputs")],
                 max_batch_size=8),
          submul)
    write("bad_output_dtype",
          config("bad_output_dtype", inputs=[f4("INPUT__0")],
                 outputs=[tensor("OUTPUT__0", "INT32", [4], comment="the model returns FP32")],
                 max_batch_size=8),
          identity)
    write("bad_scalar_output",
          config("bad_scalar_output", inputs=[f4("INPUT__0")],
                 outputs=[tensor("OUTPUT__0", "FP32", [1], comment="the model returns 0-dim")],
                 max_batch_size=0),
          serialize(Scalar()))
    write("bad_list_tensor_output",
          config("bad_list_tensor_output", inputs=[f4("INPUT__0")],
                 outputs=[f4("OUTPUT__0", comment="the model returns List[Tensor]")],
                 max_batch_size=0),
          serialize(ListOfTensors()))
    slow_io = dict(inputs=[tensor("INPUT__0", "INT64", [1], comment="iterations")],
                   outputs=[tensor("OUTPUT__0", "INT64", [1], comment="iterations done")],
                   max_batch_size=0)
    write("slow", config("slow", **slow_io, comment="busy loop of INPUT__0 iterations"), slow)
    write("slow_x2", config("slow_x2", **slow_io, extra=instances(2, "KIND_CPU"),
                            comment="two instances of the busy loop"), slow)

    # Sequence and ragged batching.
    write("sequence_accumulate",
          config("sequence_accumulate",
                 inputs=[tensor("INPUT__0", "INT32", [1])],
                 outputs=[tensor("OUTPUT__0", "INT32", [1], comment="running sum")],
                 max_batch_size=0, extra=_SEQUENCE_BATCHING,
                 comment="running sum per sequence, kept in an implicit state"),
          serialize(SequenceAccumulate()))
    write("ragged_sum",
          config("ragged_sum",
                 inputs=[tensor("INPUT__0", "FP32", [-1], extra="allow_ragged_batch: true")],
                 outputs=[tensor("OUTPUT__0", "FP32", [1], comment="sum of the request's values")],
                 max_batch_size=8, extra=_RAGGED_BATCH_INPUT + dynamic_batching(50000),
                 comment="ragged batch: one flat input plus end offsets"),
          serialize(RaggedSum()))

    # Models that must fail to load.
    write("broken_missing_file",
          config("broken_missing_file", inputs=[f4("INPUT__0")], outputs=[f4("OUTPUT__0")],
                 max_batch_size=8, comment="1/ is empty"),
          None)
    write("broken_arg_count",
          config("broken_arg_count", inputs=[f4("INPUT__0"), f4("INPUT__1")],
                 outputs=[f4("OUTPUT__0")], max_batch_size=8,
                 comment="two inputs for a one-argument forward"),
          serialize(OneArg()))
    write("broken_arg_type",
          config("broken_arg_type",
                 inputs=[f4("INPUT__0"), tensor("INPUT__1", "INT64", [1])],
                 outputs=[f4("OUTPUT__0")], max_batch_size=8,
                 comment="forward(self, x: Tensor, n: int)"),
          serialize(IntArg()))
    write("broken_two_dicts",
          config("broken_two_dicts", inputs=[f4("x")], outputs=[f4("OUTPUT__0")],
                 max_batch_size=8, comment="two Dict[str, Tensor] arguments"),
          serialize(TwoDicts()))
    write("broken_string_2d",
          config("broken_string_2d", inputs=[tensor("INPUT__0", "STRING", [-1])],
                 outputs=[tensor("OUTPUT__0", "STRING", [1], reshape=[])],
                 max_batch_size=8, comment="[-1] plus the batch dimension is 2-D"),
          serialize(UpperStrings()))
    write("broken_bool_param",
          config("broken_bool_param", inputs=[f4("INPUT__0")], outputs=[f4("OUTPUT__0")],
                 max_batch_size=8, extra=parameters(INFERENCE_MODE="maybe")),
          identity)
    write("broken_pbtxt_syntax", _BROKEN_PBTXT, identity)
    write("broken_platform_onnx",
          config("broken_platform_onnx", inputs=[f4("INPUT__0")], outputs=[f4("OUTPUT__0")],
                 max_batch_size=8, platform="onnxruntime_onnx",
                 comment="not a PyTorch model"),
          identity)
    write("broken_no_config", None, identity)
    rng = random.Random(1234)  # deterministic "random" bytes
    write("broken_corrupt_model",
          config("broken_corrupt_model", inputs=[f4("INPUT__0")], outputs=[f4("OUTPUT__0")],
                 max_batch_size=8, comment="1/model.pt is not a TorchScript archive"),
          bytes(rng.getrandbits(8) for _ in range(4096)))


_JSON_CONFIG = {
    "name": "libtorch_json_config",
    "platform": "pytorch_libtorch",
    "max_batch_size": 8,
    "input": [
        {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": ["16"]},
        {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": ["16"]},
    ],
    "output": [
        {"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": ["16"]},
        {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": ["16"]},
    ],
    "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
}

_SEQUENCE_BATCHING = """\
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    {
      name: "START__1"
      control [
        {
          kind: CONTROL_SEQUENCE_START
          int32_false_true: [ 0, 1 ]
        }
      ]
    }
  ]
  state [
    {
      input_name: "STATE_IN__2"
      output_name: "STATE_OUT__1"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: {
        name: "zero"
        data_type: TYPE_INT32
        dims: [ 1 ]
        zero_data: true
      }
    }
  ]
}
"""

_RAGGED_BATCH_INPUT = """\
batch_input [
  {
    kind: BATCH_ACCUMULATED_ELEMENT_COUNT
    target_name: "INDEX__1"
    data_type: TYPE_INT32
    source_input: "INPUT__0"
  }
]
"""

_BROKEN_PBTXT = """\
# The input block is never closed.
name: "broken_pbtxt_syntax"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  {
    name: "INPUT__0"
    data_type: TYPE_FP32
    dims: [ 4 ]
output [
  {
    name: "OUTPUT__0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
"""


# --- expectations as data ------------------------------------------------------

# Model -> versions that must be READY (gpu_instance is left out: it depends on CUDA).
EXPECTED_READY: dict[str, tuple[int, ...]] = {
    **{name: (1,) for name in [
        "libtorch_int8_int8_int8", "libtorch_int16_int16_int16",
        "libtorch_int32_int32_int32", "libtorch_float32_float32_float32",
        "libtorch_nobatch_float32_float32_float32", "libtorch_json_config",
        "custom_filename", "multi_instance", "identity_bf16",
        "naming_forward_argument", "naming_named_index", "naming_strict",
        "naming_bad_suffix", "dict_input", "all_dtypes", "string_io",
        "string_batched", "identity_fp32", "identity_batched", "input_views", "reshape_model",
        "reshape_batched", "reshape_variable", "batch_probe", "params", "params_default",
        "raise_on_negative", "bad_output_index", "bad_output_dtype",
        "bad_scalar_output", "bad_list_tensor_output", "slow", "slow_x2",
        "sequence_accumulate", "ragged_sum"]},
    "versioned": (3,),
    "versioned_latest_2": (2, 3),
    "versioned_all": (1, 2, 3),
    "versioned_specific_1_3": (1, 3),
    "versioned_numeric_order": (10,),
}


def expected_load_errors(root: Path) -> dict[str, Optional[str]]:
    """Model -> text its load error must contain (None: only "not ready")."""
    root = Path(root)
    return {
        "broken_missing_file":
            # Triton names the full path; torchpool shows it relative to the repository
            # (server paths never reach a client: docs/security.md)
            f"unable to find '{Path('broken_missing_file') / '1' / 'model.pt'}' "
            "for model instance 'broken_missing_file'",
        "broken_arg_count":
            "unable to load model 'broken_arg_count', configuration expects 2 inputs, "
            "model provides 1",
        "broken_arg_type":
            "An input of type 'int' was detected in the model. Only a single input of "
            "type Dict(str, Tensor) or input(s) of type Tensor are supported.",
        "broken_two_dicts":
            "Multiple inputs of kind DictType were detected. Only a single input of "
            "type Dict(str, Tensor) is supported.",
        "broken_string_2d":
            "Triton only supports 1 dimensional List of String as input for "
            "'INPUT__0' for model 'broken_string_2d'",
        "broken_bool_param": "failed to convert 'maybe' to boolean",
        "broken_pbtxt_syntax": "config.pbtxt",
        "broken_platform_onnx": "onnxruntime_onnx",
        "broken_no_config": None,
        "broken_corrupt_model":
            "failed to load model 'broken_corrupt_model': PytorchStreamReader failed "
            "reading zip archive",
    }


@functools.lru_cache(maxsize=None)
def slow_iterations(seconds: float) -> int:
    """Iterations of the `slow` model that take about `seconds` here (warm)."""
    model = torch.jit.script(Slow())
    probe = 20000
    with torch.inference_mode():
        for _ in range(3):  # the profiling executor's first calls are slower
            model(torch.tensor([probe]))
        start = time.perf_counter()
        model(torch.tensor([probe]))
        per_iteration = (time.perf_counter() - start) / probe
    return max(1, int(seconds / per_iteration))


# --- self-check ----------------------------------------------------------------
# Loads every model.pt in-process and checks the docstring's claims as far as
# that is possible without the server. The config checks use a minimal
# protobuf-text reader (syntax only), not the server's parser.

def _parse_pbtxt(text: str) -> dict:
    """Parse protobuf text format into nested dicts; repeated fields become lists."""
    import re
    token_re = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}\[\]:,;]|[^\s{}\[\]:,;#"]+')
    tokens = [t for t in token_re.findall(text) if t.strip() and not t.startswith("#")]
    pos = 0

    def scalar(tok: str):
        if tok.startswith('"'):
            return json.loads(tok)
        for cast in (int, float):
            try:
                return cast(tok)
            except ValueError:
                pass
        return tok

    def value():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return message("}")
        if tok == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return items
        if tok in "}],:;":
            raise ValueError(f"unexpected {tok!r} at token {pos}")
        return scalar(tok)

    def message(end: Optional[str]) -> dict:
        nonlocal pos
        fields: dict = {}
        while pos < len(tokens) and tokens[pos] != end:
            key = tokens[pos]
            if not key[0].isalpha():
                raise ValueError(f"expected a field name, got {key!r} at token {pos}")
            pos += 1
            if tokens[pos] == ":":
                pos += 1
            val = value()
            if key in fields:
                old = fields[key]
                fields[key] = (old if isinstance(old, list) else [old]) + (
                    val if isinstance(val, list) else [val])
            else:
                fields[key] = val
            if pos < len(tokens) and tokens[pos] in ",;":
                pos += 1
        if end is not None:
            if pos >= len(tokens):
                raise ValueError(f"missing {end!r}")
            pos += 1
        return fields

    try:
        result = message(None)
    except IndexError:
        raise ValueError("unexpected end of input") from None
    return result


def _triton_input_check(model: torch.jit.ScriptModule, name: str, n_inputs: int) -> Optional[str]:
    """Triton's ValidateInputs argument rules, for the self-check."""
    args = model.forward.schema.arguments[1:]  # without self
    kinds = [a.type.kind() for a in args]
    if kinds == ["DictType"]:
        return None
    if "DictType" in kinds[1:]:
        return ("Multiple inputs of kind DictType were detected. Only a single input of "
                "type Dict(str, Tensor) is supported.")
    for arg, kind in zip(args, kinds):
        if kind not in ("TensorType", "ListType"):
            return (f"An input of type '{arg.type.str()}' was detected in the model. Only a "
                    "single input of type Dict(str, Tensor) or input(s) of type Tensor are "
                    "supported.")
    if len(args) != n_inputs:
        return (f"unable to load model '{name}', configuration expects {n_inputs} inputs, "
                f"model provides {len(args)}")
    return None


def self_check(root: Path) -> None:
    root = Path(root)
    errors = expected_load_errors(root)

    def load(name: str, version: int = 1, filename: str = "model.pt") -> torch.jit.ScriptModule:
        return torch.jit.load(str(root / name / str(version) / filename))

    t = torch.tensor

    # Every config (but the broken one) is valid protobuf text; the JSON one is JSON.
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        pbtxt = model_dir / "config.pbtxt"
        if model_dir.name == "broken_pbtxt_syntax":
            try:
                _parse_pbtxt(pbtxt.read_text())
            except ValueError:
                continue
            raise AssertionError("broken_pbtxt_syntax parsed")
        if pbtxt.exists():
            parsed = _parse_pbtxt(pbtxt.read_text())
            assert parsed["name"] == model_dir.name, model_dir
        elif model_dir.name == "libtorch_json_config":
            assert json.loads((model_dir / "config.json").read_text())["name"] == model_dir.name
        else:
            assert model_dir.name == "broken_no_config", model_dir

    a = t([3, -2] * 8, dtype=torch.int8).reshape(1, 16)
    b = t([1, 5] * 8, dtype=torch.int8).reshape(1, 16)
    for name, dtype in [("libtorch_int8_int8_int8", torch.int8),
                        ("libtorch_int16_int16_int16", torch.int16),
                        ("libtorch_int32_int32_int32", torch.int32),
                        ("libtorch_float32_float32_float32", torch.float32),
                        ("libtorch_json_config", torch.int32)]:
        s, d = load(name)(a.to(dtype), b.to(dtype))
        assert torch.equal(s, (a + b).to(dtype)) and torch.equal(d, (a - b).to(dtype)), name
    total, _ = load("custom_filename", filename="weights.pt")(a.float(), b.float())
    assert torch.equal(total, (a + b).float())
    assert not (root / "custom_filename" / "1" / "model.pt").exists()

    x4 = t([[1.0, 2.0, 3.0, 4.0]])
    for name, versions in EXPECTED_READY.items():
        if name.startswith("versioned"):
            on_disk = sorted(int(p.name) for p in (root / name).iterdir() if p.name.isdigit())
            for v in on_disk:
                assert torch.equal(load(name, v)(x4), x4 * v), (name, v)
            assert max(on_disk) in versions
    assert (root / "versioned_numeric_order" / "notes").is_dir()

    p, q = t([[5.0, 1.0, 2.0, 0.0]]), t([[2.0, 4.0, 2.0, 3.0]])
    assert torch.equal(load("naming_forward_argument")(q, p), p - q)  # forward(b, a)
    for name in ("naming_named_index", "naming_strict", "naming_bad_suffix", "bad_output_index"):
        out = load(name)(p, q)
        assert len(out) == 2 and torch.equal(out[0], p - q) and torch.equal(out[1], p * q)
    assert torch.equal(load("dict_input")({"x": p, "y": q}), p * 2 + q)
    samples = [t([True, False]), t([0, 255], dtype=torch.uint8), t([-128, 127], dtype=torch.int8),
               t([-1, 2], dtype=torch.int16), t([-1, 2], dtype=torch.int32),
               t([-(2 ** 62), 2 ** 62], dtype=torch.int64), t([0.5, -1.0], dtype=torch.float16),
               t([0.5, -1.0]), t([0.5, -1.0], dtype=torch.float64)]
    for sent, got in zip(samples, load("all_dtypes")(*samples)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    bf16 = t([1.5, -2.0], dtype=torch.bfloat16)
    assert torch.equal(load("identity_bf16")(bf16), bf16)

    for name in ("string_io", "string_batched"):
        texts, lengths = load(name)(["abc", "", "hello"])
        assert texts == ["cba", "", "olleh"] and lengths.tolist() == [3, 0, 5], name
        texts, lengths = load(name)([])
        assert texts == [] and lengths.dtype == torch.int64 and lengths.shape == (0,)

    empty = torch.zeros(0)
    assert load("identity_fp32")(empty).shape == (0,)
    shape, flat = load("reshape_model")(torch.arange(12.0).reshape(3, 4))
    assert shape.tolist() == [3, 4] and torch.equal(flat, torch.arange(12.0))
    assert load("reshape_batched")(torch.zeros(2, 3, 4)).tolist() == [[2, 3, 4]] * 2
    sizes, echo = load("batch_probe")(t([[1.0], [2.0], [3.0]]))
    assert sizes.tolist() == [[3]] * 3 and echo.tolist() == [[1.0], [2.0], [3.0]]

    params = load("params")
    one = t([1.0])
    with torch.inference_mode():
        assert [o.tolist() for o in params(one)] == [[True], [False]]
        inference_input = torch.ones(1)
    with torch.no_grad():
        assert [o.tolist() for o in params(one)] == [[False], [False]]
        assert [o.tolist() for o in params(inference_input)] == [[False], [False]]

    raiser = load("raise_on_negative")
    assert torch.equal(raiser(x4), x4)
    try:
        raiser(-x4)
        raise AssertionError("raise_on_negative did not raise")
    except torch.jit.Error as exc:
        assert "boom: input sum is negative" in str(exc)
    assert load("bad_output_dtype")(x4).dtype == torch.float32
    assert load("bad_scalar_output")(x4[0]).dim() == 0
    listed = load("bad_list_tensor_output")(x4[0])
    assert isinstance(listed, list) and len(listed) == 2
    # Triton's message is "received List[" + element type + "]".
    returned = load("bad_list_tensor_output").forward.schema.returns[0].type
    assert returned.kind() == "ListType" and returned.getElementType().str() == "Tensor"
    assert load("slow")(t([1000])).tolist() == [1000]

    accumulate = load("sequence_accumulate")
    state = torch.zeros(1, dtype=torch.int32)
    totals = []
    for value, start in [(1, 1), (2, 0), (3, 0), (7, 1)]:
        total, state = accumulate(t([value], dtype=torch.int32), t([start], dtype=torch.int32),
                                  state)
        totals.append(int(total))
    assert totals == [1, 3, 6, 7], totals
    sums = load("ragged_sum")(t([1.0, 2.0, 3.0, 10.0, 20.0]), t([2, 2, 5], dtype=torch.int32))
    assert sums.tolist() == [[3.0], [0.0], [33.0]], sums

    # Broken models: what can be seen without the server.
    assert not any((root / "broken_missing_file" / "1").iterdir())
    assert str(Path("broken_missing_file") / "1" / "model.pt") in errors["broken_missing_file"]
    for name, n_inputs in [("broken_arg_count", 2), ("broken_arg_type", 2),
                           ("broken_two_dicts", 1)]:
        assert _triton_input_check(load(name), name, n_inputs) == errors[name], name
    for name, n_inputs in [("naming_forward_argument", 2), ("dict_input", 2),
                           ("all_dtypes", 9), ("string_io", 1), ("ragged_sum", 2),
                           ("sequence_accumulate", 3)]:
        assert _triton_input_check(load(name), name, n_inputs) is None, name
    try:
        load("broken_corrupt_model")
        raise AssertionError("broken_corrupt_model loaded")
    except RuntimeError as exc:
        prefix = "failed to load model 'broken_corrupt_model': "
        assert errors["broken_corrupt_model"].startswith(prefix)
        assert str(exc).startswith(errors["broken_corrupt_model"][len(prefix):]), exc
    assert not any((root / "broken_no_config" / f).exists()
                   for f in ("config.pbtxt", "config.json"))
    assert _parse_pbtxt((root / "broken_bool_param" / "config.pbtxt").read_text())[
        "parameters"]["value"]["string_value"] == "maybe"
    string_2d = _parse_pbtxt((root / "broken_string_2d" / "config.pbtxt").read_text())
    assert string_2d["max_batch_size"] > 0 and len(string_2d["input"][0]["dims"]) == 1
    assert set(EXPECTED_READY) | set(errors) | {"gpu_instance"} == {
        p.name for p in root.iterdir() if p.is_dir()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} DIR   (builds the test repository in DIR and checks it)",
              file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    start = time.perf_counter()
    build_test_repository(root)
    built = time.perf_counter() - start
    self_check(root)
    count = sum(1 for p in root.iterdir() if p.is_dir())
    print(f"built {count} models in {root} in {built:.2f} s; self-check passed "
          f"(slow: {slow_iterations(0.3)} iterations ~ 0.3 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
