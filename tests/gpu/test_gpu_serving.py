"""The GPU half end to end (issue 30), on a machine whose torch sees a CUDA
device; skipped everywhere else. `scripts/gpu-check` runs these there.

- A KIND_GPU instance loads on its GPU, says so (`torchpool ps`'s device,
  the model's config), reports the GPU memory its process holds, and
  answers with the right values: small inputs,
  16 MiB, and a batching MLP whose answers match the same module run
  in-process on the GPU.
- A device-side assert in one model (an index out of range on the GPU)
  fails that request with an error naming the model, the worker is
  replaced, and another model on the same GPU answers throughout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import Tensor, nn  # noqa: E402

from torchpool import Client, InferenceError, OutputRef, SharedMemoryRef  # noqa: E402

from ..support.daemon import Daemon, wait_for  # noqa: E402
from ..support.models.core import config, dynamic_batching, instances, serialize, tensor, write_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

MiB = 1 << 20


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class AssertOnNegative(nn.Module):
    """x[0] < 0 indexes far past the end on the GPU: a device-side assert
    (the CUDA context is then unusable for the rest of the process)."""

    def forward(self, x: Tensor) -> Tensor:
        index = (x[:1] < 0).long() * 1_000_000_000
        return x.index_select(0, index) + 1


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def gpu_repository(root: Path) -> None:
    fp32 = [tensor("INPUT__0", "FP32", [-1])]
    out = [tensor("OUTPUT__0", "FP32", [-1])]
    write_model_dir(root, "identity_gpu", model=serialize(Identity()),
                    config_text=config("identity_gpu", inputs=fp32, outputs=out, max_batch_size=0,
                                       extra=instances(1, "KIND_GPU")))
    write_model_dir(root, "assert_gpu", model=serialize(AssertOnNegative()),
                    config_text=config("assert_gpu", inputs=fp32, outputs=out, max_batch_size=0,
                                       extra=instances(1, "KIND_GPU")))
    write_model_dir(root, "mlp_gpu", model=serialize(mlp()),
                    config_text=config("mlp_gpu", inputs=[tensor("INPUT__0", "FP32", [256])],
                                       outputs=[tensor("OUTPUT__0", "FP32", [10])], max_batch_size=32,
                                       extra=instances(1, "KIND_GPU") + dynamic_batching(500)))


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("gpu_repository")
    gpu_repository(root)
    d = Daemon(root, tmp_path_factory.mktemp("gpu_daemon")).start(timeout=180)
    yield d
    assert d.stop() == 0, d.log()


def instance_row(c: Client, model: str) -> dict:
    (row,) = c.statistics(model)["model_stats"][0]["instances"]
    return row


def test_a_gpu_instance_loads_on_its_gpu_and_answers(gpu_daemon: Daemon) -> None:
    with Client(gpu_daemon.url, timeout=120) as c:
        cfg = c.model_config("identity_gpu")
        assert cfg["instance_group"][0]["kind"] == "KIND_GPU" and cfg["instance_group"][0]["gpus"] == [0]
        x = np.arange(16, dtype=np.float32)
        np.testing.assert_array_equal(c.infer("identity_gpu", {"INPUT__0": x})["OUTPUT__0"], x)
        big = np.random.default_rng(0).standard_normal(16 * MiB // 4).astype(np.float32)
        np.testing.assert_array_equal(c.infer("identity_gpu", {"INPUT__0": big})["OUTPUT__0"], big)
        assert instance_row(c, "identity_gpu")["device"] == "cuda:0"      # as `torchpool ps` shows it
        # its GPU memory as NVML reports it (a CUDA context alone is tens of MiB or more); the
        # broker reads NVML on a thread, so the first rows may come before its first reading
        held = wait_for(lambda: instance_row(c, "identity_gpu")["gpu_memory_bytes"], 15,
                        "the worker's GPU memory in its statistics (None: NVML named no pid of the "
                        "daemon's workers; a container with its own pid namespace?)")
        assert held > 16 * MiB, held


def test_the_batching_mlp_on_the_gpu_answers_as_in_process(gpu_daemon: Daemon) -> None:
    model = mlp().cuda().eval()
    xs = np.random.default_rng(1).standard_normal((40, 256)).astype(np.float32)
    with torch.inference_mode():
        expected = model(torch.from_numpy(xs).cuda()).cpu().numpy()
    with Client(gpu_daemon.url, timeout=120) as c:
        for i in range(len(xs)):
            out = c.infer("mlp_gpu", {"INPUT__0": xs[i:i + 1]})["OUTPUT__0"]
            np.testing.assert_allclose(out, expected[i:i + 1], rtol=1e-4, atol=1e-4)


def test_a_device_side_assert_fails_its_request_and_other_models_keep_serving(gpu_daemon: Daemon) -> None:
    x = np.arange(1, 17, dtype=np.float32)
    with Client(gpu_daemon.url, timeout=120) as c:
        np.testing.assert_array_equal(c.infer("assert_gpu", {"INPUT__0": x})["OUTPUT__0"], x[:1] + 1)
        before = instance_row(c, "assert_gpu")["pid"]
        with pytest.raises(InferenceError) as info:
            c.infer("assert_gpu", {"INPUT__0": -x})
        assert "assert_gpu" in str(info.value), str(info.value)
        # the other model on the same GPU answers meanwhile and after
        np.testing.assert_array_equal(c.infer("identity_gpu", {"INPUT__0": x})["OUTPUT__0"], x)
        # the broken worker is replaced (its CUDA context is lost) and the model answers again

        def answered_by_a_new_worker() -> bool:
            try:
                out = c.infer("assert_gpu", {"INPUT__0": x})["OUTPUT__0"]
            except InferenceError:
                return False
            return instance_row(c, "assert_gpu")["pid"] != before and bool((out == x[:1] + 1).all())
        wait_for(answered_by_a_new_worker, 120, "assert_gpu answering from a new worker")
        np.testing.assert_array_equal(c.infer("identity_gpu", {"INPUT__0": x})["OUTPUT__0"], x)


def cuda_region(t: "torch.Tensor") -> tuple[bytes, int]:
    """The CUDA IPC handle of the allocation that holds `t` (torch's caching
    allocator exports the whole segment), and where `t` starts in it."""
    _device, handle, _size, offset, *_ = t.untyped_storage()._share_cuda_()
    return handle, offset


def test_cuda_shared_memory_in_and_out(gpu_daemon: Daemon) -> None:
    """Triton's CUDA shared memory from the ZeroMQ client: an input read
    from the client's GPU memory, an output written into it; a region
    registered larger than its allocation is refused before any read, and
    the worker keeps serving (issue 30, item 6)."""
    x = torch.arange(4096, dtype=torch.float32, device="cuda:0")
    out = torch.zeros(4096, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    (h_in, off_in), (h_out, off_out) = cuda_region(x), cuda_region(out)
    with Client(gpu_daemon.url, timeout=120) as c:
        c.register_cuda_shared_memory("gpu_in", h_in, 0, off_in + x.nbytes)
        c.register_cuda_shared_memory("gpu_out", h_out, 0, off_out + out.nbytes)
        listed = {r["name"]: (r["device_id"], r["byte_size"]) for r in c.get_cuda_shared_memory_status()}
        assert listed == {"gpu_in": (0, off_in + x.nbytes), "gpu_out": (0, off_out + out.nbytes)}
        result = c.infer("identity_gpu", {"INPUT__0": SharedMemoryRef("gpu_in", x.nbytes, off_in, "FP32", [4096])},
                         outputs=[OutputRef("OUTPUT__0", "gpu_out", out.nbytes, off_out)])
        assert "OUTPUT__0" in result
        torch.cuda.synchronize()
        assert torch.equal(out, x)
        c.register_cuda_shared_memory("too_big", h_in, 0, 1 << 40)
        with pytest.raises(InferenceError) as info:
            c.infer("identity_gpu", {"INPUT__0": SharedMemoryRef("too_big", 4096, (1 << 40) - 4096, "FP32", [1024])})
        assert "registered larger than it is" in str(info.value), str(info.value)
        np.testing.assert_array_equal(c.infer("identity_gpu", {"INPUT__0": np.ones(4, np.float32)})["OUTPUT__0"],
                                      np.ones(4, np.float32))
        c.unregister_cuda_shared_memory()
        assert c.get_cuda_shared_memory_status() == []
