"""Triton's classification extension, computed in the worker.

A requested output may ask for its top k classes instead of the tensor
(`{"name": ..., "classification": k}` on the wire, `internal.Classify` in a
RUN). The answer is a BYTES tensor of "score:index" strings, or
"score:index:label" when the output's `label_filename` names a label for
that index, as Triton's server returns it:

- per batch item for a batching model (`max_batch_size` > 0): each item's
  elements, flattened, are ranked; shape [batch, min(k, elements per item)];
  otherwise the whole tensor, flattened: shape [min(k, elements)];
- highest value first; equal values by lower index first (Triton sorts with
  an unstable `std::sort`, so its order of ties is unspecified: this one is
  deterministic);
- the score as C++'s `std::to_string` prints it: "%f" for FP32/FP64 (six
  decimals), a plain integer for the integer types;
- labels are the lines of the label file (a file in the model directory,
  read once at load), index = line number from 0; an index past the last
  line, or an empty line, has no label and its string no ":label" part.

The broker has already refused what Triton refuses (a non-numeric output,
BOOL, FP16, BF16, a k that is not a positive integer), and runs a request
with a classified output in a batch of its own, so every row of `value`
belongs to the one request that asked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import torch

from ..config.model_config import ModelConfig
from ..protocol import datatypes, internal
from ..protocol.errors import INTERNAL, INVALID_ARG
from .settings import ExecutionError, ModelLoadError

if TYPE_CHECKING:
    from .binding import Value


_FLOATS = frozenset({torch.float32, torch.float64})
_INTEGERS = frozenset({torch.uint8, torch.uint16, torch.uint32, torch.uint64,
                       torch.int8, torch.int16, torch.int32, torch.int64})
_SCORED = _FLOATS | _INTEGERS


class Classified(list):
    """One output's class strings (bytes), in row-major order, and the shape
    they have: written out as BYTES like a `List[str]` output, but [batch, k]
    where a string list is one-dimensional."""

    __slots__ = ("shape",)

    def __init__(self, items: Iterable[bytes], shape: list[int]) -> None:
        super().__init__(items)
        self.shape = shape


def split_lines(data: bytes) -> list[bytes]:
    """The labels of a label file: its lines as `std::getline` reads them
    (split at "\\n" only, a final line without one counts, no empty label
    after a final "\\n")."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def read_labels(config: ModelConfig, model_dir: Path) -> dict[str, list[bytes]]:
    """{output name: labels} for every output with a `label_filename`, read
    from the model directory. A file that cannot be read fails the load, as
    in Triton (whether or not a request ever asks for classes)."""
    labels: dict[str, list[bytes]] = {}
    for entry in config.raw.get("output", ()):
        filename = entry.get("label_filename") or ""
        if not filename:
            continue
        path = Path(model_dir) / filename
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"failed to load model '{config.name}': unable to read label file "
                                 f"'{path}' of output '{entry['name']}': {exc.strerror or exc}",
                                 INTERNAL) from None
        labels[entry["name"]] = split_lines(data)
    return labels


def _format(score: float, is_float: bool, index: int, labels: Sequence[bytes]) -> bytes:
    text = (b"%f:%d" if is_float else b"%d:%d") % (score, index)
    if index < len(labels) and labels[index]:
        text += b":" + labels[index]
    return text


def top_k(value: torch.Tensor, count: int, batched: bool, labels: Sequence[bytes] = ()) -> Classified:
    """The top `count` classes of an output tensor (CPU; integer, FP32 or
    FP64), per batch item when `batched`, as "score:index[:label]" bytes."""
    if batched:
        rows = value.shape[0]
        per = 1
        for d in value.shape[1:]:
            per *= d
        prefix = [rows]
    else:
        rows, per, prefix = 1, value.numel(), []
    k = min(count, per)
    flat = value.reshape(rows, per)
    # a stable sort, not topk: ties must come out in index order
    ranked = torch.sort(flat, dim=1, descending=True, stable=True)
    scores, order = ranked.values[:, :k].tolist(), ranked.indices[:, :k].tolist()
    is_float = value.dtype in _FLOATS
    items = [_format(score, is_float, index, labels)
             for row_scores, row_order in zip(scores, order)
             for score, index in zip(row_scores, row_order)]
    return Classified(items, prefix + [k])


@dataclass(frozen=True)
class Classifier:
    """A model's labels, and the classification of the outputs a batch asked
    classified."""

    model: str
    batched: bool
    labels: Mapping[str, Sequence[bytes]] = field(default_factory=dict)

    @classmethod
    def load(cls, config: ModelConfig, model_dir: Path) -> "Classifier":
        return cls(config.name, config.max_batch_size > 0, read_labels(config, model_dir))

    def apply(self, results: dict[str, Value],
              targets: Mapping[str, internal.Classify | internal.OutputTarget]
              ) -> dict[str, internal.OutputTarget]:
        """Replace each result that `targets` asks classified (`Classify`)
        by its class strings; returns the other targets (outputs written into
        regions)."""
        rest: dict[str, internal.OutputTarget] = {}
        for name, target in targets.items():
            if isinstance(target, internal.Classify):
                if name in results:
                    results[name] = self.classify(name, results[name], target.count)
            else:
                rest[name] = target
        return rest

    def classify(self, name: str, value: Value, count: int) -> Classified:
        if not isinstance(value, torch.Tensor) or value.dtype not in _SCORED:
            kind = "BYTES" if isinstance(value, list) else _wire_name(value.dtype)
            raise ExecutionError(f"output '{name}' for model '{self.model}': class result not "
                                 f"available for output due to unsupported type '{kind}'", INVALID_ARG)
        if not isinstance(count, int) or count < 1:
            raise ExecutionError(f"output '{name}' for model '{self.model}': 'classification' must be "
                                 f"a positive integer, got {count!r}", INVALID_ARG)
        return top_k(value, count, self.batched, self.labels.get(name, ()))


def _wire_name(dtype: torch.dtype) -> str:
    try:
        return datatypes.wire_from_torch(dtype)
    except KeyError:
        return str(dtype).removeprefix("torch.").upper()
