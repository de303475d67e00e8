"""--stream-copy-bytes (shm/bulkcopy.py): the broker and its workers copy
into shared memory with streaming stores from the size it gives; what they
copy is exact either way. TORCHPOOL_STREAM_COPY_BYTES, the only way before
the flag, is its default."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torch import Tensor, nn

from torchpool.client import Client
from torchpool.examples import IDENTITY_CONFIG, serialize, write_model

from ..support.daemon import Daemon, free_tcp_port

pytest.importorskip("torchpool.shm._streamcopy", reason="the _streamcopy extension is not built")

MiB = 1 << 20


class TimesOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 1               # a new tensor of the input's size


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream_copy_repository")
    write_model(root, "times_one", IDENTITY_CONFIG.replace('"identity"', '"times_one"'), serialize(TimesOne()))
    return root


def serve_12mib_both_ways(d: Daemon) -> None:
    x = (np.arange(3 * MiB, dtype=np.float32) % 977) - 3.5          # 12 MiB
    with Client(d.urls[1], timeout=60, local=False) as inline:      # the broker copies it into its arena
        np.testing.assert_array_equal(inline.infer("times_one", {"INPUT__0": x})["OUTPUT__0"], x)
    with Client(d.url, timeout=60) as local:
        with local.infer("times_one", {"INPUT__0": x}) as out:
            np.testing.assert_array_equal(out["OUTPUT__0"], x)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_threshold_reaches_the_broker_and_its_workers(repository: Path, tmp_path: Path, how: str) -> None:
    flags = ["--stream-copy-bytes", "1M"] if how == "flag" else []
    env = {"TORCHPOOL_STREAM_COPY_BYTES": str(MiB)} if how == "environment" else {"TORCHPOOL_STREAM_COPY_BYTES": "0"}
    d = Daemon(repository, tmp_path, *flags, "--log-level", "debug", tcp_port=free_tcp_port(), env=env).start()
    try:
        serve_12mib_both_ways(d)
        log = d.log()
        assert "copies of 1048576 bytes and more into shared memory store around the CPU caches" in log
        assert "model 'times_one' instance 'times_one_0': copies of 1048576 bytes and more store around" in log
    finally:
        assert d.stop() == 0, d.log()


def test_zero_turns_it_off_over_the_environment(repository: Path, tmp_path: Path) -> None:
    d = Daemon(repository, tmp_path, "--stream-copy-bytes", "0", "--log-level", "debug", tcp_port=free_tcp_port(),
               env={"TORCHPOOL_STREAM_COPY_BYTES": str(MiB)}).start()
    try:
        serve_12mib_both_ways(d)
        assert "store around the CPU caches" not in d.log()
    finally:
        assert d.stop() == 0, d.log()
