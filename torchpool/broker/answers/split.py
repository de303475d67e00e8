"""Each request's own part of a finished batch's outputs.

A batch's outputs are split back per request without copying: rows along
dim 0 (from `Batch.row_starts` when the batch has rows of no request),
`BYTES` by element count, `BATCH_SCATTER_WITH_INPUT_SHAPE` by each
request's source input shape; an output `reshape` is undone. A classified
output (Triton's classification extension, computed by the worker) belongs
to a batch of one request and is passed on as the worker wrote it. Outputs a
worker answered as views of an input block are checked to lie in one.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence, Union, cast

from ...config import ModelConfig, TensorSpec
from ...protocol import datatypes, errors
from ...protocol.errors import TorchpoolError
from ...rules.split import row_spans
from ...protocol.internal import SegmentRef
from ..batch import Batch, CopiedOutput, OutputEntry, OutputPiece

if TYPE_CHECKING:
    from ..schedulers.base import ReadOutput

SCATTER = "BATCH_SCATTER_WITH_INPUT_SHAPE"

# an output's part for one request, before its name is put in front: OutputPiece less the name
_Part = tuple[str, Sequence[int], Union[SegmentRef, CopiedOutput], int, int]


def output_shape(spec: Optional[TensorSpec], shape: Sequence[int], batching: bool) -> Sequence[int]:
    """Undo an output `reshape`: the client sees the config's `dims`. (No
    spec: a sequence state output, kept as the model made it.)"""
    if spec is None or spec.reshape is None:
        return shape
    dims = ([shape[0]] if batching and shape else []) + list(spec.dims)
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        total = math.prod(shape)
        dims[dims.index(-1)] = total // known if known else 0
    return dims


def scatter_sources(cfg: ModelConfig) -> dict[str, str]:
    """BATCH_SCATTER_WITH_INPUT_SHAPE outputs and their source inputs."""
    return {str(t): entry["source_input"][0] for entry in cfg.batch_outputs
            if entry.get("kind", SCATTER) == SCATTER for t in entry["target_name"]}


def check_reused_outputs(batch: Batch, descriptors: Sequence[OutputEntry], reused: frozenset[str],
                         label: str) -> None:
    """A worker said these outputs are views of input blocks handed over for
    reuse: each must lie inside such an input of this batch (which then has
    one request), or the answer would point at memory the client did not
    offer. Raises TorchpoolError otherwise."""
    offered = [d for d in batch.inputs if d.reuse]
    for name, _datatype, _shape, segment, offset, nbytes in descriptors:
        if name not in reused:
            continue
        if len(batch.requests) != 1 or not any(
                d.segment == segment and d.offset <= offset and offset + nbytes <= d.offset + d.nbytes
                for d in offered):
            raise TorchpoolError(errors.INTERNAL, f"{label}: output '{name}' was answered as a view "
                                                  f"of an input block it does not lie in")


def split_outputs(cfg: ModelConfig, batch: Batch, descriptors: Sequence[OutputEntry],
                  read: ReadOutput) -> list[list[OutputPiece]]:
    """Each request's own part of a batch's outputs.

    `descriptors` are the worker's `[name, datatype, shape, segment, offset,
    nbytes]`; `read(segment, offset, nbytes)` gives an output's bytes (only
    BYTES outputs are read). Returns, per request, `(name, datatype, client
    shape, segment, offset, nbytes)` for each output it asked for, in its
    order: a byte sub-range of the batch output, no copy. Raises
    TorchpoolError when the model's outputs cannot be split.
    """
    requests = batch.requests
    model = cfg.name
    batching = cfg.max_batch_size > 0
    scatter = scatter_sources(cfg)
    single = len(requests) == 1 and batch.row_starts is None
    starts = batch.starts()
    parts: dict[str, list[_Part]] = {}
    for name, datatype, shape, segment, offset, nbytes in descriptors:
        spec = cfg.output(name)
        pieces: list[_Part]
        if name in scatter:
            if datatype == "BYTES" or batch.row_starts is not None:
                what = "BYTES" if datatype == "BYTES" else "rows of no request (empty sequence slots)"
                raise TorchpoolError(errors.UNSUPPORTED, f"output '{name}' of model '{model}': "
                                                         f"{SCATTER} does not support {what}")
            size = datatypes.element_size(datatype)
            pos, pieces = offset, []
            for r in requests:
                src = list(r.shapes[scatter[name]])
                n = math.prod(src) * size
                pieces.append((datatype, src, segment, pos, n))
                pos += n
            if pos - offset > nbytes:
                raise TorchpoolError(errors.INTERNAL,
                                     f"output '{name}' of model '{model}' has {nbytes} bytes, but "
                                     f"scattering it with the shapes of input '{scatter[name]}' needs "
                                     f"{pos - offset}")
        elif single:
            pieces = [(datatype, output_shape(spec, shape, batching), segment, offset, nbytes)]
        elif datatype == "BYTES":
            spans = row_spans(model, name, shape[0] if shape else 0, [r.rows for r in requests], starts,
                              batch.rows, strings=True)
            per_row = (shape[0] // batch.rows) if batch.rows else 0
            if not isinstance(segment, (str, CopiedOutput)):   # a region's [key, inode]: such a request runs alone
                raise TorchpoolError(errors.INTERNAL, f"output '{name}' of model '{model}' was written into "
                                                      f"a region by a batch of several requests")
            try:
                bounds = datatypes.bytes_boundaries(read(segment, offset, nbytes), [per_row] * batch.rows)
            except ValueError as exc:
                raise TorchpoolError(errors.INTERNAL, f"output '{name}' of model '{model}' is a "
                                                      f"truncated BYTES tensor: {exc}") from None
            # bounds[k]: the byte where row k's strings begin
            pieces = []
            for (lo, hi), r, first in zip(spans, requests, starts):
                b0, b1 = bounds[first], bounds[first + r.rows]
                pieces.append((datatype, output_shape(spec, [hi - lo], batching), segment, offset + b0, b1 - b0))
        else:
            # (a scalar output has no rows: counted as 0, refused)
            spans = row_spans(model, name, shape[0] if shape else 0, [r.rows for r in requests], starts,
                              batch.rows, strings=False)
            row = nbytes // batch.rows if batch.rows else 0
            pieces = [(datatype, output_shape(spec, [hi - lo] + list(shape[1:]), batching), segment,
                       offset + lo * row, (hi - lo) * row) for lo, hi in spans]
        parts[name] = pieces
    out = []
    for i, r in enumerate(requests):
        mine = []
        for o in r.outputs:
            if isinstance(o, str):
                name = o
            else:
                name = cast(str, o[0])           # [name, ...] (rules/validation.WorkerOutput)
                if len(o) == 2 and name in parts:      # [name, k]: classified
                    mine.append(_classified(name, descriptors, single, model))
                    continue
            if name in parts:
                datatype, shape, segment, offset, nbytes = parts[name][i]
                mine.append((name, datatype, shape, segment, offset, nbytes))
        out.append(mine)
    return out


def _classified(name: str, descriptors: Sequence[OutputEntry], single: bool, model: str) -> OutputPiece:
    """A classified output as the worker wrote it: BYTES "score:index[:label]",
    [batch, k] or [k]. Its shape is not the config's (no `reshape` to undo),
    and it cannot be split: such a request runs alone (requests.batch_layout)."""
    if not single:
        raise TorchpoolError(errors.INTERNAL, f"output '{name}' of model '{model}' was classified in "
                                              f"a batch of several requests")
    for d in descriptors:
        if d[0] == name:
            return d.name, d.datatype, d.shape, d.segment, d.offset, d.nbytes
    raise TorchpoolError(errors.INTERNAL, f"output '{name}' of model '{model}' is missing")
