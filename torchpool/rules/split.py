"""Which part of a batch's output is each request's: the one row splitter.

A batch's output is split back per request along its first dimension: each
request owns the rows it sent, at the row where its inputs were placed in
the batch (`starts`: a request's first row; a sequence batch may leave rows
of no request between them). A fixed-size output has one entry per row; a
BYTES output has the same number of strings per row. The broker splits its
batches' outputs as byte ranges of the worker's answer
(broker/answers/split.py), the worker its own direct batches as tensors and
string lists (worker/direct_batch.py): both take each request's span from
here, and refuse an output that cannot be split with the same words.
"""
from __future__ import annotations

from typing import Sequence

from ..protocol import errors
from ..protocol.errors import TorchpoolError


def row_spans(model: str, output: str, count: int, rows: Sequence[int], starts: Sequence[int],
              batch_rows: int, strings: bool) -> list[tuple[int, int]]:
    """Each request's [first, end) along the output's first dimension.

    `count`: the output's length along it (strings for BYTES, `strings`);
    `rows[i]` and `starts[i]`: request i's rows and its first row in a batch
    of `batch_rows`. Raises TorchpoolError (INTERNAL) when the output does not
    have the batch's rows first (a batched output must keep the batch
    dimension first) or, for BYTES, a whole number of strings per row."""
    if strings:
        if batch_rows == 0 or count % batch_rows:
            raise TorchpoolError(errors.INTERNAL, f"output '{output}' of model '{model}' has {count} "
                                                  f"strings for a batch of {batch_rows}: it cannot be "
                                                  f"split per request")
        per_row = count // batch_rows
    else:
        if count != batch_rows:
            raise TorchpoolError(errors.INTERNAL, f"output '{output}' of model '{model}' has {count} "
                                                  f"rows for a batch of {batch_rows} rows from "
                                                  f"{len(rows)} requests: a batched output must keep "
                                                  f"the batch dimension first")
        per_row = 1
    return [(first * per_row, (first + n) * per_row) for n, first in zip(rows, starts)]
