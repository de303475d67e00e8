"""The GPU figures of issue 30, item 7, in one run (scripts/gpu-check runs it on
the GPU machine; `--cpu --quick` rehearses every step here, tiny and on the
CPU, so a GPU minute is not spent finding a typo).

1. Bandwidth between shared memory and the GPU: a POSIX shared-memory
   segment as the worker maps one, copied to and from the device as is
   (pageable: what a worker does today), and registered with the CUDA driver
   (cudaHostRegister through torch.cuda.cudart(), once; what issue 30 item 2
   asks for), beside torch's own pinned tensor (the goal: the registered
   segment at >= 80% of it). Registration's own cost per GiB is shown: it is
   why it must happen once per segment, never per request.
2. Round trips through the daemon (KIND_GPU, a local Client) beside the same
   model in this process on the same device: a 16 MiB identity and the
   example MLP, c=1 p50; the MLP with dynamic batching at c=8 (throughput).
3. GPU memory of each worker (nvidia-smi's per-process figure): what one
   CUDA context per instance costs.
"""
from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

MiB = 1 << 20


def p50(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(size: int, device: str, n: int) -> dict:
    import posix_ipc

    name = f"/torchpool-gpu-measure-{uuid.uuid4().hex[:8]}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    mapping = mmap.mmap(shm.fd, size)
    shm.close_fd()
    posix_ipc.unlink_shared_memory(name)
    try:
        return _copies(torch.frombuffer(mapping, dtype=torch.uint8), size, device, n)
    finally:
        mapping.close()         # (the tensor viewing it is gone with _copies' frame)


def _copies(host: torch.Tensor, size: int, device: str, n: int) -> dict:
    host.fill_(1)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gbs = lambda seconds: round(size / seconds / 1e9, 2)   # noqa: E731
    out: dict[str, Any] = {"bytes": size}
    out["h2d_pageable_GBs"] = gbs(p50(lambda: dev.copy_(host), n, sync))
    out["d2h_pageable_GBs"] = gbs(p50(lambda: host.copy_(dev), n, sync))
    if cuda:
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(host.data_ptr(), size, 0)
        register_s = time.perf_counter() - t0
        out["register_error"] = int(err)
        out["register_s_per_GiB"] = round(register_s / (size / (1 << 30)), 4)
        out["h2d_registered_GBs"] = gbs(p50(lambda: dev.copy_(host, non_blocking=True), n, sync))
        out["d2h_registered_GBs"] = gbs(p50(lambda: host.copy_(dev, non_blocking=True), n, sync))
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out["h2d_torch_pinned_GBs"] = gbs(p50(lambda: dev.copy_(pinned, non_blocking=True), n, sync))
        out["d2h_torch_pinned_GBs"] = gbs(p50(lambda: pinned.copy_(dev, non_blocking=True), n, sync))
        out["h2d_registered_vs_pinned"] = round(out["h2d_registered_GBs"] / out["h2d_torch_pinned_GBs"], 3)
        out["d2h_registered_vs_pinned"] = round(out["d2h_registered_GBs"] / out["d2h_torch_pinned_GBs"], 3)
        cudart.cudaHostUnregister(host.data_ptr())
    return out


def repository(root: Path, kind: str) -> None:
    """identity and the example MLP (with and without dynamic batching) on `kind`."""
    from tests.gpu.test_gpu_serving import Identity, mlp
    from tests.support.models.core import config, dynamic_batching, instances, serialize, tensor, write_model_dir

    fp32, out = [tensor("INPUT__0", "FP32", [-1])], [tensor("OUTPUT__0", "FP32", [-1])]
    write_model_dir(root, "identity", model=serialize(Identity()),
                    config_text=config("identity", inputs=fp32, outputs=out, max_batch_size=0,
                                       extra=instances(1, kind)))
    io = dict(inputs=[tensor("INPUT__0", "FP32", [256])], outputs=[tensor("OUTPUT__0", "FP32", [10])],
              max_batch_size=32)
    write_model_dir(root, "mlp", model=serialize(mlp()), config_text=config("mlp", **io, extra=instances(1, kind)))
    write_model_dir(root, "mlp_batched", model=serialize(mlp()),
                    config_text=config("mlp_batched", **io, extra=instances(1, kind) + dynamic_batching(200)))


def worker_gpu_memory(pids: list[int]) -> dict:
    import subprocess

    found = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    used = {}
    for line in found.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            used[int(parts[0])] = int(parts[1])
    return {str(pid): used.get(pid) for pid in pids}


def daemon_round_trips(device: str, quick: bool) -> dict:
    from tests.gpu.test_gpu_serving import Identity, mlp
    from tests.support.daemon import Daemon
    from torchpool import Client

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = 10 if quick else 50
    big_bytes = (1 if quick else 16) * MiB
    big = np.random.default_rng(0).standard_normal(big_bytes // 4).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    out: dict[str, Any] = {"identity_bytes": big_bytes}
    identity, net = torch.jit.script(Identity()).to(device), torch.jit.script(mlp()).to(device).eval()
    with torch.inference_mode():
        out["inprocess_identity_p50_s"] = p50(lambda: identity(torch.from_numpy(big).to(device)).cpu(), n, sync)
        out["inprocess_mlp_p50_s"] = p50(lambda: net(torch.from_numpy(x).to(device)).cpu(), n * 4, sync)
    with tempfile.TemporaryDirectory(prefix="torchpool-gpu-") as tmp:
        root = Path(tmp)
        repository(root / "repo", "KIND_GPU" if cuda else "KIND_CPU")
        d = Daemon(root / "repo", root).start(timeout=300)
        try:
            with Client(d.url, timeout=120) as c:
                out["daemon_identity_p50_s"] = p50(lambda: c.infer("identity", {"INPUT__0": big}), n, lambda: None)
                out["daemon_mlp_p50_s"] = p50(lambda: c.infer("mlp", {"INPUT__0": x}), n * 4, lambda: None)
                rows = {m: c.statistics(m)["model_stats"][0]["instances"] for m in ("identity", "mlp", "mlp_batched")}
            out["devices"] = {m: [r["device"] for r in rs] for m, rs in rows.items()}
            seconds, done = (1.0 if quick else 5.0), [0]

            def load() -> None:
                with Client(d.url, timeout=120) as c:
                    c.infer("mlp_batched", {"INPUT__0": x})
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        c.infer("mlp_batched", {"INPUT__0": x})
                        done[0] += 1
            threads = [threading.Thread(target=load) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out["mlp_batched_c8_rps"] = round(done[0] / seconds, 1)
            if cuda:
                out["worker_gpu_memory_MiB"] = worker_gpu_memory([r["pid"] for rs in rows.values() for r in rs])
                # the daemon's own figure (NVML, broker/nvml.py), beside nvidia-smi's
                with Client(d.url, timeout=120) as c:
                    out["worker_gpu_memory_MiB_daemon"] = {
                        str(r["pid"]): None if r.get("gpu_memory_bytes") is None else r["gpu_memory_bytes"] >> 20
                        for m in rows for r in c.statistics(m)["model_stats"][0]["instances"]}
        finally:
            d.stop()
    for key in [k for k in out if k.endswith("_p50_s")]:
        out[key] = round(out[key], 6)
    out["identity_daemon_vs_inprocess"] = round(out["daemon_identity_p50_s"] / out["inprocess_identity_p50_s"], 2)
    out["mlp_daemon_vs_inprocess"] = round(out["daemon_mlp_p50_s"] / out["inprocess_mlp_p50_s"], 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="rehearse on the CPU (no CUDA needed)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_measure: torch sees no CUDA device (use --cpu to rehearse)", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda:0"
    results = {"device": device if args.cpu else torch.cuda.get_device_name(0), "torch": torch.__version__,
               "bandwidth": bandwidth((8 if args.quick else 256) * MiB, device, 5 if args.quick else 20),
               "round_trips": daemon_round_trips(device, args.quick)}
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
