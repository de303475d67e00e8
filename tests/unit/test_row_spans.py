"""The one row splitter (rules/split.py) both the broker and the worker use."""
import pytest

from torchpool.protocol import errors
from torchpool.protocol.errors import TorchpoolError
from torchpool.rules.split import row_spans


def test_fixed_size_outputs_split_by_the_rows_each_request_sent() -> None:
    assert row_spans("m", "OUT", 6, [1, 3, 2], [0, 1, 4], 6, strings=False) == [(0, 1), (1, 4), (4, 6)]


def test_rows_of_no_request_are_skipped() -> None:
    # a sequence batch: slots 0 and 2 of 3 hold requests, slot 1 is empty
    assert row_spans("m", "OUT", 3, [1, 1], [0, 2], 3, strings=False) == [(0, 1), (2, 3)]


def test_strings_split_by_a_whole_number_per_row() -> None:
    assert row_spans("m", "TEXT", 6, [1, 2], [0, 1], 3, strings=True) == [(0, 2), (2, 6)]
    assert row_spans("m", "TEXT", 0, [1, 2], [0, 1], 3, strings=True) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("count, strings, says", [
    (3, False, "output 'OUT' of model 'm' has 3 rows for a batch of 2 rows from 2 requests: a batched "
               "output must keep the batch dimension first"),
    (0, False, "has 0 rows for a batch of 2 rows"),
    (3, True, "output 'OUT' of model 'm' has 3 strings for a batch of 2: it cannot be split per request"),
])
def test_an_output_that_cannot_be_split_is_refused_in_the_same_words(count: int, strings: bool,
                                                                      says: str) -> None:
    with pytest.raises(TorchpoolError) as info:
        row_spans("m", "OUT", count, [1, 1], [0, 1], 2, strings=strings)
    assert info.value.code == errors.INTERNAL
    assert says in info.value.message
