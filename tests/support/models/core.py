"""What every catalogue uses to write a model: config text and TorchScript files.

`config(...)` with `tensor(...)` entries, plus the optional blocks
`parameters`, `instances` and `dynamic_batching`, make a config.pbtxt in the
layout Triton's own examples use; `serialize(module)` (torchpool.examples')
scripts a module and returns its TorchScript bytes; `write_model_dir(root, name, ...)` lays out
`root/name/config.pbtxt` and one `root/name/<version>/<file>` per version.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from torchpool.examples import serialize

__all__ = ["config", "dynamic_batching", "fp32_4", "instances", "parameters", "serialize", "tensor",
           "write_model_dir"]


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


def fp32_4(name: str, *, comment: str = "") -> str:
    """An FP32 entry of dims [4], the most common one."""
    return tensor(name, "FP32", [4], comment=comment)


def config(name: str, *, inputs: Sequence[str], outputs: Sequence[str],
           max_batch_size: int, comment: str = "", extra: str = "",
           backend: bool = False, platform: str = "pytorch_libtorch") -> str:
    """A whole config.pbtxt; `backend` says `backend: "pytorch"` instead of the platform."""
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

def write_model_dir(root: Path, name: str, config_text: Optional[str], model: Optional[bytes], *,
                    versions: Sequence[int] = (1,), filename: str = "model.pt",
                    config_file: str = "config.pbtxt") -> None:
    """`root/name/config_file` (unless None) and `root/name/<v>/filename` (unless None)."""
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    if config_text is not None:
        (model_dir / config_file).write_text(config_text)
    for version in versions:
        version_dir = model_dir / str(version)
        version_dir.mkdir(exist_ok=True)
        if model is not None:
            (version_dir / filename).write_bytes(model)
