"""Example model repositories for demos, `scripts/run` and benchmarks.

`build_example_repository(root)` writes a small Triton-style repository:

    addsub      INPUT0, INPUT1 FP32 [16] (batch 8)  -> OUTPUT0 = a + b, OUTPUT1 = a - b
    mlp         INPUT__0 FP32 [256] (batch 32)      -> OUTPUT__0 FP32 [10]   (256-1024-1024-10)
    strings     INPUT__0 STRING [-1] (no batching)  -> OUTPUT__0 = each string upper-cased
    dict_input  x, y FP32 [4] (batch 8)             -> OUTPUT__0 = x * 2 + y   (Dict[str, Tensor])
    identity    INPUT__0 FP32 [-1] (no batching)    -> OUTPUT__0 = INPUT__0 (big tensors)
    clone       INPUT__0 FP32 [-1] (no batching)    -> OUTPUT__0 = a new tensor equal to INPUT__0

`build_example_repository(root, pt2=True)` adds the MLP in its PyTorch 2 forms
(the same weights; docs/pytorch2.md):

    mlp_exported  the MLP exported with torch.export (batch Dim 1..32), model.pt2
    mlp_aoti      that program compiled by AOTInductor (tens of seconds on 2 cores)
    mlp_compiled  the TorchScript MLP with TORCH_COMPILE: compiled when it loads

They are optional (`scripts/make_example_repo --pt2`) because the
AOTInductor compile would make every `scripts/run` and every test session
that builds this repository tens of seconds slower.

`addsub_repository(root, count)` writes `count` copies of `addsub` named
`addsub_00`, `addsub_01`, ... (one KIND_CPU instance each) to measure the
startup of many models.

Every module is scripted once and serialised once; each copy is the same bytes
written to another place, so building stays well under a second apart from
importing torch.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn


# --- TorchScript modules ------------------------------------------------------

class AddSub(nn.Module):
    """Triton's `simple` example: sum and difference of two tensors."""

    def forward(self, input0: Tensor, input1: Tensor) -> Tuple[Tensor, Tensor]:
        return input0 + input1, input0 - input1


class MLP(nn.Module):
    """A small dense network: enough work per request to show batching pay off."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(),
            nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class UpperStrings(nn.Module):
    """TYPE_STRING in and out: a TorchScript `List[str]` on both sides."""

    def forward(self, text: List[str]) -> List[str]:
        return [s.upper() for s in text]


class DictInput(nn.Module):
    """A single `Dict[str, Tensor]` argument: config input names are the keys."""

    def forward(self, inputs: Dict[str, Tensor]) -> Tensor:
        return inputs["x"] * 2 + inputs["y"]


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class Clone(nn.Module):
    # The same values as a new tensor: unlike identity's, its output is
    # written out of the model's memory into shared memory.
    def forward(self, x: Tensor) -> Tensor:
        return x.clone()


# --- configurations (as Triton users write them) -------------------------------

ADDSUB_CONFIG = """\
# Triton's `simple` add/sub model, as TorchScript.
# INPUT0/INPUT1 are neither forward() argument names nor <name>__<index>
# names, so inputs bind in config order (STRICT_CONFIG_ORDERING).
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  {{
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }},
  {{
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }}
]
output [
  {{
    name: "OUTPUT0"   # INPUT0 + INPUT1
    data_type: TYPE_FP32
    dims: [ 16 ]
  }},
  {{
    name: "OUTPUT1"   # INPUT0 - INPUT1
    data_type: TYPE_FP32
    dims: [ 16 ]
  }}
]
{extra}"""

ADDSUB_ONE_CPU_INSTANCE = """\
instance_group [
  {
    count: 1
    kind: KIND_CPU
  }
]
"""

MLP_CONFIG = """\
# 256 -> 1024 -> 1024 -> 10 MLP with fixed weights (torch.manual_seed(0)).
name: "mlp"
backend: "pytorch"
max_batch_size: 32
input [
  {
    name: "INPUT__0"
    data_type: TYPE_FP32
    dims: [ 256 ]
  }
]
output [
  {
    name: "OUTPUT__0"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }
]
# No queue delay: batch whatever is already waiting, never wait for more.
dynamic_batching { }
"""

STRINGS_CONFIG = """\
# forward(self, text: List[str]) -> List[str]: every string upper-cased.
# TYPE_STRING must be 1-D including the batch dimension, hence no batching.
name: "strings"
platform: "pytorch_libtorch"
max_batch_size: 0
input [
  {
    name: "INPUT__0"
    data_type: TYPE_STRING
    dims: [ -1 ]
  }
]
output [
  {
    name: "OUTPUT__0"
    data_type: TYPE_STRING
    dims: [ -1 ]
  }
]
"""

DICT_INPUT_CONFIG = """\
# forward(self, inputs: Dict[str, Tensor]): the input names are the dict keys.
name: "dict_input"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  {
    name: "x"
    data_type: TYPE_FP32
    dims: [ 4 ]
  },
  {
    name: "y"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT__0"   # x * 2 + y
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
"""

IDENTITY_CONFIG = """\
# Returns its input unchanged; any length (a 16 MiB tensor is [ 4194304 ]).
name: "identity"
platform: "pytorch_libtorch"
max_batch_size: 0
input [
  {
    name: "INPUT__0"
    data_type: TYPE_FP32
    dims: [ -1 ]
  }
]
output [
  {
    name: "OUTPUT__0"
    data_type: TYPE_FP32
    dims: [ -1 ]
  }
]
"""


# --- writing ------------------------------------------------------------------

def serialize(module: nn.Module) -> bytes:
    """Script a module and return the bytes `torch.jit.save` would write."""
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def write_model(root: Path, name: str, config: str, model: bytes,
                versions: Sequence[int] = (1,), filename: str = "model.pt") -> None:
    """Write `<root>/<name>/config.pbtxt` and `<version>/<filename>` per version."""
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config)
    for version in versions:
        version_dir = model_dir / str(version)
        version_dir.mkdir(exist_ok=True)
        (version_dir / filename).write_bytes(model)


def _mlp() -> MLP:
    # Fixed weights without disturbing the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # Inference only: no autograd graph on the weights.
        return MLP().eval().requires_grad_(False)


def build_example_repository(root: Path, pt2: bool = False) -> list[str]:
    """Write the example models under `root` (with `pt2` also the MLP's PyTorch 2
    forms); return their names."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    models = {
        "addsub": (ADDSUB_CONFIG.format(name="addsub", extra=""), serialize(AddSub())),
        "mlp": (MLP_CONFIG, serialize(_mlp())),
        "strings": (STRINGS_CONFIG, serialize(UpperStrings())),
        "dict_input": (DICT_INPUT_CONFIG, serialize(DictInput())),
        "identity": (IDENTITY_CONFIG, serialize(Identity())),
        "clone": (IDENTITY_CONFIG.replace('"identity"', '"clone"').replace(
            "Returns its input unchanged", "Returns a copy of its input"), serialize(Clone())),
    }
    for name, (config, model) in models.items():
        write_model(root, name, config, model)
    names = list(models)
    if pt2:
        names += build_pt2_examples(root, models["mlp"][1])
    return names


def _mlp_config(name: str, comment: str, extra: str) -> str:
    config = MLP_CONFIG.replace('name: "mlp"', f'name: "{name}"')
    config = config.replace("# 256 -> 1024 -> 1024 -> 10 MLP with fixed weights (torch.manual_seed(0)).",
                            f"# The example MLP (same weights) {comment}.")
    return config + extra


def mlp_program() -> "torch.export.ExportedProgram":
    """The MLP exported with a dynamic batch dimension of 1 to 32 (its max_batch_size)."""
    import warnings

    batch = torch.export.Dim("batch", min=1, max=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(_mlp(), (torch.zeros(2, 256),), dynamic_shapes=({0: batch},))


def build_pt2_examples(root: Path, torchscript_mlp: bytes) -> list[str]:
    """mlp_exported, mlp_aoti and mlp_compiled under `root`; returns their names."""
    import tempfile
    import warnings

    program = mlp_program()
    pt2_file = 'default_model_filename: "model.pt2"\n'
    with tempfile.TemporaryDirectory() as work:
        exported = Path(work) / "exported.pt2"
        torch.export.save(program, str(exported))
        write_model(root, "mlp_exported", _mlp_config(
            "mlp_exported", "as a torch.export program (torch.export.save)", pt2_file), exported.read_bytes(),
            filename="model.pt2")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(work) / "aoti.pt2"))
        write_model(root, "mlp_aoti", _mlp_config(
            "mlp_aoti", "compiled ahead of time by AOTInductor (aoti_compile_and_package)", pt2_file),
            Path(package).read_bytes(), filename="model.pt2")
    write_model(root, "mlp_compiled", _mlp_config(
        "mlp_compiled", "as TorchScript, compiled by torch.compile when it loads",
        'parameters { key: "TORCH_COMPILE" value: { string_value: "true" } }\n'), torchscript_mlp)
    return ["mlp_exported", "mlp_aoti", "mlp_compiled"]


def addsub_repository(root: Path, count: int) -> list[str]:
    """Write `count` add/sub models `addsub_00`, `addsub_01`, ...; return their names."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    model = serialize(AddSub())
    width = max(2, len(str(count - 1)))
    names = [f"addsub_{i:0{width}d}" for i in range(count)]
    for name in names:
        config = ADDSUB_CONFIG.format(name=name, extra=ADDSUB_ONE_CPU_INSTANCE)
        write_model(root, name, config, model)
    return names
