"""Copies into shared memory (torchpool.shm.bulkcopy): exact at every size and
alignment, on both sides of the streaming threshold."""
from __future__ import annotations

import numpy as np
import pytest

from torchpool.shm import bulkcopy
from torchpool.shm.segment import Segment

MiB = 1 << 20
STREAM_AT = 12 * MiB      # a threshold an operator may set (TORCHPOOL_STREAM_COPY_BYTES)


def test_the_streaming_extension_is_built_and_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # scripts/test installs torchpool with its C extension; without it
    # TORCHPOOL_STREAM_COPY_BYTES would silently do nothing, so a missing build must fail here
    assert bulkcopy._streamcopy is not None
    monkeypatch.delenv("TORCHPOOL_STREAM_COPY_BYTES", raising=False)
    assert bulkcopy.stream_bytes_from_environment() == 0
    monkeypatch.setenv("TORCHPOOL_STREAM_COPY_BYTES", str(STREAM_AT))
    assert bulkcopy.stream_bytes_from_environment() == STREAM_AT
    assert bulkcopy.stream_bytes_from_environment({"TORCHPOOL_STREAM_COPY_BYTES": "lots"}) == 0
    assert bulkcopy.stream_bytes_from_environment({"TORCHPOOL_STREAM_COPY_BYTES": "-5"}) == 0


def test_the_threshold_set_at_start_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_stream_threshold: what the daemon and its workers do with --stream-copy-bytes."""
    monkeypatch.setattr(bulkcopy, "STREAMING", bulkcopy.STREAMING)      # put back afterwards
    monkeypatch.setattr(bulkcopy, "STREAM_BYTES", bulkcopy.STREAM_BYTES)
    bulkcopy.set_stream_threshold(STREAM_AT)
    assert bulkcopy.streams(STREAM_AT) and not bulkcopy.streams(STREAM_AT - 1)
    bulkcopy.set_stream_threshold(0)
    assert not bulkcopy.streams(1 << 40)
    bulkcopy.set_stream_threshold(-1)
    assert not bulkcopy.streams(1 << 40)


@pytest.fixture(params=["ordinary", "streamed from 12 MiB"])
def streaming(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    on = request.param != "ordinary"
    monkeypatch.setattr(bulkcopy, "STREAMING", on)
    monkeypatch.setattr(bulkcopy, "STREAM_BYTES", STREAM_AT if on else 0)


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 4095, 4096 * 4 + 17, STREAM_AT - 1, STREAM_AT, STREAM_AT + 4097])
@pytest.mark.parametrize("dst_offset", [0, 8, 64 + 24])
def test_copy_into_shared_memory_is_exact_at_every_size_and_alignment(nbytes: int, dst_offset: int,
                                                                       streaming: None) -> None:
    seg = Segment.create(f"torchpool.test-bulkcopy-{nbytes}-{dst_offset}", nbytes + 2 * 4096)
    try:
        src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        dst = memoryview(seg.buf)[dst_offset:dst_offset + nbytes + 128]
        guard = np.frombuffer(seg.buf, np.uint8)
        guard[:] = 0xAB
        bulkcopy.copy_into(dst, src)
        np.testing.assert_array_equal(guard[dst_offset:dst_offset + nbytes], src)
        # nothing before or after the range was touched
        assert (guard[:dst_offset] == 0xAB).all() and (guard[dst_offset + nbytes:] == 0xAB).all()
        del dst, guard
    finally:
        seg.close()


def test_copy_into_takes_bytes_and_shaped_arrays() -> None:
    out = bytearray(4 * MiB)
    view = memoryview(out)
    bulkcopy.copy_into(view, b"torchpool")
    assert out[:9] == b"torchpool"
    grid = np.arange(12, dtype=np.float32).reshape(3, 4)
    bulkcopy.copy_into(view, grid)
    np.testing.assert_array_equal(np.frombuffer(out, np.float32, count=12), grid.reshape(-1))
    with pytest.raises(ValueError, match="do not fit"):
        bulkcopy._streamcopy.copy(view[:4], b"0123456789")
    with pytest.raises(TypeError):
        bulkcopy._streamcopy.copy(b"read-only", b"0")
