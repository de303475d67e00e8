"""GPU memory as NVML reports it (broker/nvml.py), read through a library with
NVML's ABI built from tests/support/nvml/fake_nvml.c: the calls, the records'
layout, a buffer too small, a figure NVML cannot give, and a host without the
library. The real library is read by scripts/gpu-check on a GPU machine."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchpool.broker.metrics import MetricsConfig, render_metrics, take_snapshot
from torchpool.broker.nvml import NvmlLibrary, NvmlSampler, load
from torchpool.broker.usage import PssSampler, instance_row

from ..support.daemon import wait_for

SOURCE = Path(__file__).resolve().parent.parent / "support" / "nvml" / "fake_nvml.c"
MIB = 1 << 20


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the NVML stand-in")
    out = tmp_path_factory.mktemp("nvml") / "libfake-nvml.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(SOURCE)], check=True)
    return str(out)


def test_reading_through_the_library(fake_nvml: str) -> None:
    reading = NvmlLibrary(fake_nvml).read()
    assert [(g.index, g.uuid, g.total_bytes, g.used_bytes, g.utilization) for g in reading.gpus] == [
        (0, "GPU-fake-1", 80 << 30, 1 << 30, 0.42), (1, "GPU-fake-2", 80 << 30, 2 << 30, None)]
    # this process on both GPUs, summed; the 300 others of GPU 2 (asked for again); the one
    # NVML could not measure left out
    assert reading.process_bytes[os.getpid()] == 500 * MIB
    assert {pid: n for pid, n in reading.process_bytes.items() if pid != os.getpid()} == {
        100000 + i: MIB for i in range(300)}
    assert reading.error == ""


def test_a_host_without_the_library() -> None:
    assert load("/nonexistent/libnvidia-ml.so.1") == (None, "")
    sampler = NvmlSampler(library=lambda: load("/nonexistent/libnvidia-ml.so.1"))
    sampler.reading()
    wait_for(lambda: sampler._read_at is not None, 10, "the sampler's first reading")
    assert sampler.reading().gpus == () and sampler.reading().process_bytes == {}


def test_workers_rows_and_metrics(fake_nvml: str) -> None:
    sampler = NvmlSampler(every=60, library=lambda: load(fake_nvml))
    assert sampler.reading().gpus == ()                   # never read yet: not waited for
    wait_for(lambda: sampler.reading().gpus, 10, "the sampler's first reading")
    now = time.monotonic()

    def handle(name: str, device: str) -> SimpleNamespace:
        return SimpleNamespace(process=SimpleNamespace(pid=os.getpid()),
                               spec=SimpleNamespace(instance=name, device=device, threads=1),
                               state="IDLE", stopping=False, started=now)

    gpu_row = instance_row(handle("m_0", "cuda:0"), 0, now, PssSampler(), sampler)
    cpu_row = instance_row(handle("m_1", "cpu"), 0, now, PssSampler(), sampler)
    assert gpu_row is not None and gpu_row["gpu_memory_bytes"] == 500 * MIB
    assert cpu_row is not None and cpu_row["gpu_memory_bytes"] is None

    snap = take_snapshot(None, lambda mv: 0, {}, sampler)
    snap.instances = [("m", 1, gpu_row), ("m", 1, cpu_row)]
    page = render_metrics(snap, MetricsConfig()).decode()
    lines = set(page.splitlines())
    assert 'nv_gpu_utilization{gpu_uuid="GPU-fake-1"} 0.42' in lines
    assert not any(line.startswith('nv_gpu_utilization{gpu_uuid="GPU-fake-2"}') for line in lines)
    assert {f'nv_gpu_memory_total_bytes{{gpu_uuid="GPU-fake-{i}"}} {80 << 30}' for i in (1, 2)} <= lines
    assert {f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-fake-{i}"}} {i << 30}' for i in (1, 2)} <= lines
    worker = [line for line in lines if line.startswith("torchpool_worker_gpu_memory_bytes{")]
    assert worker == [f'torchpool_worker_gpu_memory_bytes{{model="m",model_instance="m_0",version="1"}} '
                      f'{500 * MIB}']


def test_no_gpu_families_without_gpus() -> None:
    sampler = NvmlSampler(library=lambda: (None, ""))
    page = render_metrics(take_snapshot(None, lambda mv: 0, {}, sampler), MetricsConfig()).decode()
    assert "nv_gpu_" not in page
