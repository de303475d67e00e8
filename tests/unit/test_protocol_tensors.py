"""protocol/tensors.py: the one encoder/decoder of the wire's tensor entry."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from torchpool.client import decode_infer, encode_infer
from torchpool.protocol import datatypes, messages, tensors
from torchpool.protocol.errors import INVALID_ARG, TorchpoolError

FIXED = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
         "FP16", "BF16", "FP32", "FP64"]


def roundtrip(datatype: str, arr: np.ndarray) -> tuple[dict, list, np.ndarray]:
    entry = tensors.tensor_entry("T", datatype, arr.shape)
    frames: list = []
    tensors.put_data(entry, arr, frames)
    header = messages.unpack(messages.pack({"outputs": [entry]}))      # through msgpack
    got = header["outputs"][0]
    return got, frames, tensors.decode_array(got["datatype"], got["shape"],
                                             tensors.tensor_payload(got, frames))


@pytest.mark.parametrize("datatype", FIXED)
def test_every_fixed_datatype_round_trips_inline_and_as_a_frame(datatype: str) -> None:
    dtype = datatypes.numpy_dtype(datatype)
    for count, inline in ((6, True), (tensors.INLINE_LIMIT // dtype.itemsize + 1, False)):
        arr = (np.arange(count) % 2).astype(dtype).reshape(-1, 1) if datatype == "BOOL" \
            else np.arange(count).astype(dtype).reshape(-1, 1)
        entry, frames, back = roundtrip(datatype, arr)
        assert isinstance(entry["data"], bytes) == inline
        assert len(frames) == (0 if inline else 1) and (inline or entry["data"] == 1)
        assert back.dtype == dtype and back.shape == arr.shape and np.array_equal(back, arr)


def test_inline_limit_is_inclusive_and_make_frame_is_used() -> None:
    frames: list = []
    at = np.zeros(tensors.INLINE_LIMIT, np.uint8)
    e1 = tensors.tensor_entry("A", "UINT8", at.shape)
    assert tensors.put_data(e1, at, frames) is None and e1["data"] == bytes(tensors.INLINE_LIMIT)
    over = np.ones(tensors.INLINE_LIMIT + 1, np.uint8)
    e2 = tensors.tensor_entry("B", "UINT8", over.shape)
    made = tensors.put_data(e2, over, frames, make_frame=lambda d: ("frame", d.nbytes))
    assert made == ("frame", tensors.INLINE_LIMIT + 1) and frames == [made] and e2["data"] == 1
    e3 = tensors.tensor_entry("C", "UINT8", over.shape)
    tensors.put_data(e3, over, frames)
    assert e3["data"] == 2 and bytes(frames[1]) == over.tobytes()


def test_empty_strided_byteswapped_and_bytes() -> None:
    empty = np.zeros((0, 4), np.float32)
    entry, frames, back = roundtrip("FP32", empty)
    assert entry["data"] == b"" and back.shape == (0, 4)
    strided = np.arange(32, dtype=np.int32).reshape(4, 8)[:, ::2]
    _, _, back = roundtrip("INT32", strided)
    assert back.tolist() == strided.tolist()
    swapped = np.arange(5, dtype=">f8")
    entry, _, back = roundtrip("FP64", swapped)
    assert entry["data"] == np.arange(5, dtype="<f8").tobytes() and back.tolist() == [0, 1, 2, 3, 4]
    encoded = datatypes.encode_bytes([b"ab", "c\u00e9", b""])
    entry = tensors.tensor_entry("S", "BYTES", [3])
    tensors.put_data(entry, encoded, [])
    assert entry["data"] == b"\x02\x00\x00\x00ab\x03\x00\x00\x00c\xc3\xa9\x00\x00\x00\x00"
    out = tensors.decode_array("BYTES", [3], tensors.tensor_payload(entry, []))
    assert out.dtype == object and out.tolist() == [b"ab", "c\u00e9".encode(), b""]


def test_payload_errors_name_the_tensor() -> None:
    with pytest.raises(TorchpoolError) as exc:
        tensors.tensor_payload({"name": "X", "data": 2}, [b"only one"])
    assert exc.value.code == INVALID_ARG and "'X'" in exc.value.message and "frame 2" in exc.value.message
    with pytest.raises(TorchpoolError) as exc:
        tensors.tensor_payload({"name": "Y", "data": True}, [b"f"])   # a bool is not an index
    assert "'Y' has no data" in exc.value.message


def test_descriptors_put_locate_and_parse() -> None:
    e = tensors.tensor_entry("A", "FP32", [1, 4096])
    tensors.put_shm(e, "seg", 128, 16384, 7, reuse=True)
    assert e == {"name": "A", "datatype": "FP32", "shape": [1, 4096],
                 "shm": ["seg", 128, 16384, 7], "reuse": True}
    assert tensors.location(e) == tensors.SHM and tensors.shm_ref(e) == ("seg", 128, 16384, 7)
    o = tensors.tensor_entry("B", "FP32", [4])
    tensors.put_own(o, "seg", 192, 16)
    assert tensors.location(o) == tensors.OWN and tensors.own_ref(o).offset == 192
    r = tensors.tensor_entry("C", "FP32", [4])
    tensors.put_region(r, "region0", 16, 64)
    assert r["region"] == ["region0", 16, 64] and tensors.region_ref(r) == ("region0", 16, 64)
    assert tensors.location({"data": b""}) == tensors.DATA
    assert tensors.output_request("OUT", "region0", 64, 128) == {"name": "OUT", "region": ["region0", 64, 128]}
    for bad in ({"name": "A", "shm": ["seg", 0, 1]}, {"name": "A", "shm": ["seg", "0", 1, 1]},
                {"name": "A", "shm": "seg"}):
        with pytest.raises(TorchpoolError) as exc:
            tensors.shm_ref(bad)
        assert exc.value.code == INVALID_ARG and "'A'" in exc.value.message


def test_worth_descriptor_boundary() -> None:
    assert not tensors.worth_descriptor(tensors.LOCAL_MIN_BYTES)
    assert tensors.worth_descriptor(tensors.LOCAL_MIN_BYTES + 1)
    assert messages.INLINE_LIMIT == tensors.INLINE_LIMIT == 64 * 1024
    assert messages.LOCAL_MIN_BYTES == tensors.LOCAL_MIN_BYTES == 16 * 1024


def test_block_header_is_defined_once() -> None:
    regions = pytest.importorskip("torchpool.shm.regions")
    assert regions.HEADER_BYTES == tensors.BLOCK_HEADER_BYTES == 64
    assert regions.BLOCK_HEADER is tensors.BLOCK_HEADER_LAYOUT and regions.BLOCK_MAGIC == tensors.BLOCK_MAGIC
    buf = bytearray(64)
    tensors.write_block_header(buf, 0, 9, 100)
    assert tensors.read_block_header(buf, 0) == (tensors.BLOCK_MAGIC, 9, 100)
    tensors.clear_block_header(buf, 0)
    assert buf == bytearray(64)


def test_encode_infer_frames_and_decode_infer() -> None:
    small = np.ones((1, 16), np.float32)
    big = np.arange(20000, dtype=np.float32)                     # 80,000 bytes: a frame
    frames = encode_infer(7, "m", {"A": small, "B": big, "S": ["x", "yz"]}, ["O"], None, 1.5)
    assert len(frames) == 2
    header = messages.unpack(frames[0])
    a, b, s = header["inputs"]
    assert a["data"] == small.tobytes() and b["data"] == 1 and s["datatype"] == "BYTES"
    assert header["timeout_us"] == 1_500_000 and header["outputs"] == ["O"] and header["id"] == 7
    out = decode_infer({"outputs": [a, b, s]}, frames[1:])
    assert np.array_equal(out["A"], small) and np.array_equal(out["B"], big)
    assert out["S"].tolist() == [b"x", b"yz"]


def test_the_client_imports_and_decodes_without_torch() -> None:
    """A client-only install has no torch: importing the client and decoding
    every output kind must not need it (BF16 then comes back as raw uint16)."""
    code = """
import sys
sys.modules['torch'] = None          # any 'import torch' now fails
import numpy as np
from torchpool.client import Client, AsyncClient, InferenceError
from torchpool.client.values import output_array
bits = np.array([0x3f80, 0x4000], np.uint16)
out = output_array({"name": "B", "datatype": "BF16", "shape": [2], "data": bits.tobytes()}, [])
assert out.dtype == np.uint16 and out.tolist() == [0x3f80, 0x4000], out
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
