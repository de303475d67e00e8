"""Outputs made where they are sent (torchpool.worker.capture): a model that
returns a new large tensor is answered from where it made it, with no copy
by the worker: for a local client, the client's own lending area in the
worker (torchpool.worker.lending), the only worker memory lent to it.

A local client sees where each output was lent: the memfd its array lies
in (a lending area is named `...w<n>.l<i>`); an output it was not lent
comes as bytes (an array of its own). Real daemons: one with the default
region, one whose regions hold only 16 MiB (--output-capture-mib 16: what
does not fit is copied and sent as bytes), one sized by the environment
variable that came before the flag, and one with capture turned off
(outputs are copied into the area, then lent).
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from torchpool.client import AsyncClient, Client
from torchpool.examples import IDENTITY_CONFIG, serialize, write_model

from ..support.daemon import Daemon, free_tcp_port
from ..support.mappings import mapped_file

pytest.importorskip("torchpool.worker._outcapture", reason="the _outcapture extension is not built")

MiB = 1 << 20
FLOATS_12MIB = 3 * MiB


class TimesOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 1               # a new tensor of the input's size


class TwoOutputs(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 1, x * 2


class Keeps(nn.Module):
    """Keeps what it returns: the worker must copy it (the model could change it)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = torch.zeros(0)

    def forward(self, x: Tensor) -> Tensor:
        y = x + 1
        self.last = y
        return y


def config(name: str, outputs: int = 1, batching: str = "") -> str:
    text = IDENTITY_CONFIG.replace('"identity"', f'"{name}"')
    if outputs == 2:
        text = text.replace('output [\n  {\n    name: "OUTPUT__0"\n    data_type: TYPE_FP32\n    dims: [ -1 ]\n  }\n]',
                            'output [\n  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },\n'
                            '  { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ -1 ] }\n]')
        assert "OUTPUT__1" in text
    if batching:
        text = text.replace("max_batch_size: 0", "max_batch_size: 8") + batching
    return text


def build_repository(root: Path) -> Path:
    write_model(root, "times_one", config("times_one"), serialize(TimesOne()))
    write_model(root, "two_outputs", config("two_outputs", outputs=2), serialize(TwoOutputs()))
    write_model(root, "keeps", config("keeps"), serialize(Keeps()))
    write_model(root, "batched", config("batched", batching="dynamic_batching { max_queue_delay_microseconds: "
                                                              "200000 preferred_batch_size: [ 4 ] }\n"),
                serialize(TimesOne()))
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("capture_repository"))


def start(repository: Path, workdir: Path, region_mib: Optional[int], env: Optional[dict] = None) -> Daemon:
    flags = [] if region_mib is None else ["--output-capture-mib", str(region_mib)]
    return Daemon(repository, workdir, *flags, tcp_port=free_tcp_port(), env=env).start()


@pytest.fixture(scope="module")
def daemon(repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = start(repository, tmp_path_factory.mktemp("capture_daemon"), None)
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def small_region(repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = start(repository, tmp_path_factory.mktemp("small_region_daemon"), 16)
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


def lent_from(array: np.ndarray) -> str:
    """Where an output array of a local client lies, as this process maps it
    (/proc/self/maps): "area" (a worker's lending area, the memfd
    `torchpool.<id>.<pid>.w<n>.l<i>`), "bytes" (not lent: the client's own
    memory), else the mapping's name (a worker's capture region or arena
    would be a leak of other clients' memory)."""
    name = mapped_file(array)
    if not name or not name.startswith("/memfd:torchpool."):
        return "bytes"
    if re.fullmatch(r"/memfd:torchpool\.\S+\.w\d+\.l\d+ \(deleted\)", name):
        return "area"
    return name


def ramp(n: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) % 1000) + start


def test_a_new_12mib_tensor_is_answered_from_the_capture_region(daemon: Daemon) -> None:
    x = ramp(FLOATS_12MIB)
    with Client(daemon.url, timeout=60) as c:
        for _ in range(3):
            with c.infer("times_one", {"INPUT__0": x}) as out:
                np.testing.assert_array_equal(out["OUTPUT__0"], x)
                assert lent_from(out["OUTPUT__0"]) == "area"


def test_two_outputs_each_come_from_the_region(daemon: Daemon) -> None:
    x = ramp(MiB, 1.0)
    with Client(daemon.url, timeout=60) as c:
        with c.infer("two_outputs", {"INPUT__0": x}) as out:
            np.testing.assert_array_equal(out["OUTPUT__0"], x)
            np.testing.assert_array_equal(out["OUTPUT__1"], 2 * x)
            assert [lent_from(out[n]) for n in ("OUTPUT__0", "OUTPUT__1")] == ["area", "area"]


def test_inline_frames_carry_the_same_values(daemon: Daemon) -> None:
    x = ramp(FLOATS_12MIB, 2.0)
    for url in daemon.urls:
        with Client(url, timeout=60, local=False) as c:
            for _ in range(3):
                out = c.infer("two_outputs", {"INPUT__0": x})
                np.testing.assert_array_equal(out["OUTPUT__0"], x)
                np.testing.assert_array_equal(out["OUTPUT__1"], 2 * x)


def test_a_batch_is_answered_in_sub_ranges_of_the_region(daemon: Daemon) -> None:
    async def main() -> list:
        async with AsyncClient(daemon.url, timeout=60) as c:
            inputs = [ramp(MiB // 4, 10.0 * i).reshape(1, -1) for i in range(4)]
            results = await asyncio.gather(*(c.infer("batched", {"INPUT__0": x}) for x in inputs))
            seen = []
            for x, r in zip(inputs, results):
                np.testing.assert_array_equal(r["OUTPUT__0"], x)
                seen.append(lent_from(r["OUTPUT__0"]))
            return seen

    with Client(daemon.url, timeout=10, local=False) as c:
        before = c.statistics("batched")["model_stats"][0]["execution_count"]
    segments = asyncio.run(main())
    with Client(daemon.url, timeout=10, local=False) as c:
        executions = c.statistics("batched")["model_stats"][0]["execution_count"] - before
    assert executions < 4, "the requests were not batched"
    assert segments == ["area"] * 4


def test_an_output_the_model_keeps_is_copied(daemon: Daemon) -> None:
    """The model keeps what it returns: the worker copies it. Once a tensor the
    model keeps was made in a client's area, that area is never lent (the
    client could watch other clients' requests change it) and the instance
    captures into its own region from then on, copying outputs into areas."""
    x = ramp(MiB)
    with Client(daemon.url, timeout=60) as c:
        where = []
        for i in range(4):
            with c.infer("keeps", {"INPUT__0": x + i}) as out:
                np.testing.assert_array_equal(out["OUTPUT__0"], x + i + 1)
                where.append(lent_from(out["OUTPUT__0"]))
    # the first copy made the client's area; the second ran capturing into it, the model
    # kept its tensor there: that answer went as bytes, the area was retired
    assert where == ["area", "bytes", "area", "area"]
    assert "keeps tensors it makes in forward" in daemon.log()


def test_blocks_come_back_request_after_request(small_region: Daemon) -> None:
    """A 16 MiB region holds one 12 MiB output: every answer coming from it
    means every block came back before the next request ran, whichever way
    the answers went."""
    x = ramp(FLOATS_12MIB, 3.0)
    with Client(small_region.urls[1], timeout=60, local=False) as inline:
        for _ in range(10):
            np.testing.assert_array_equal(inline.infer("times_one", {"INPUT__0": x})["OUTPUT__0"], x)
    with Client(small_region.url, timeout=60) as c:
        for i in range(20):
            with c.infer("times_one", {"INPUT__0": x}) as out:
                np.testing.assert_array_equal(out["OUTPUT__0"], x)
                # (the first may find the last inline block still being sent)
                assert i == 0 or lent_from(out["OUTPUT__0"]) == "area", f"request {i}"


def test_an_output_larger_than_the_region_is_copied(small_region: Daemon) -> None:
    x = ramp(5 * MiB, 4.0)                 # 20 MiB
    with Client(small_region.url, timeout=60) as c:
        with c.infer("times_one", {"INPUT__0": x}) as out:
            np.testing.assert_array_equal(out["OUTPUT__0"], x)
            assert lent_from(out["OUTPUT__0"]) == "bytes"
        y = ramp(FLOATS_12MIB, 5.0)        # and the next one that fits is not
        with c.infer("times_one", {"INPUT__0": y}) as out:
            np.testing.assert_array_equal(out["OUTPUT__0"], y)
            assert lent_from(out["OUTPUT__0"]) == "area"


def test_a_client_that_keeps_its_outputs_does_not_wedge_the_worker(small_region: Daemon) -> None:
    """Outputs still lent fill the region; the next ones are copied, and
    once they are given back the region serves again."""
    with Client(small_region.url, timeout=60) as c:
        kept = []
        for i in range(4):                 # 6 MiB each: two fit in 16 MiB
            x = ramp(6 * MiB // 4, 100.0 * i)
            out = c.infer("times_one", {"INPUT__0": x})
            np.testing.assert_array_equal(out["OUTPUT__0"], x)
            kept.append((x, out))
        where = [lent_from(out["OUTPUT__0"]) for _, out in kept]
        assert where == ["area", "area", "bytes", "bytes"]
        for x, out in kept:                # nothing was overwritten meanwhile
            np.testing.assert_array_equal(out["OUTPUT__0"], x)
        for _, out in kept:
            out.release()
        del kept, out
        x = ramp(FLOATS_12MIB, 6.0)
        for _ in range(2):                 # the releases travel with the first of these
            with c.infer("times_one", {"INPUT__0": x}) as out:
                np.testing.assert_array_equal(out["OUTPUT__0"], x)
                last = lent_from(out["OUTPUT__0"])
        assert last == "area"


def test_the_environment_variable_still_sizes_the_region_and_the_flag_wins(repository: Path,
                                                                            tmp_path: Path) -> None:
    """TORCHPOOL_OUTPUT_CAPTURE_MIB is --output-capture-mib's default: 16 MiB
    holds no 20 MiB output (bytes); the flag given too wins (256 MiB: lent)."""
    x = ramp(5 * MiB, 8.0)                 # 20 MiB
    where = {}
    for flag in (None, 256):
        workdir = tmp_path / f"flag{flag}"
        workdir.mkdir()
        d = start(repository, workdir, flag, env={"TORCHPOOL_OUTPUT_CAPTURE_MIB": "16"})
        try:
            with Client(d.url, timeout=60) as c:
                with c.infer("times_one", {"INPUT__0": x}) as out:
                    np.testing.assert_array_equal(out["OUTPUT__0"], x)
                    where[flag] = lent_from(out["OUTPUT__0"])
        finally:
            assert d.stop() == 0, d.log()
    assert where == {None: "bytes", 256: "area"}


def test_with_capture_off_outputs_are_copied_as_before(repository: Path, tmp_path: Path) -> None:
    d = start(repository, tmp_path, 0)
    try:
        x = ramp(FLOATS_12MIB, 7.0)
        with Client(d.url, timeout=60) as c:
            with c.infer("times_one", {"INPUT__0": x}) as out:
                np.testing.assert_array_equal(out["OUTPUT__0"], x)
                assert lent_from(out["OUTPUT__0"]) == "area"
    finally:
        assert d.stop() == 0, d.log()
