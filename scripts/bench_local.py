"""Benchmark section for the local shared-memory path (imported by bench.py).

Measured against two 16 MiB memcpys between pre-faulted buffers, warm in a
loop, in the same run. The identity model returns its input, so its output
comes back in the client's own arena block: one copy in all. `clone` returns
a new tensor: the model's clone and the worker's write of the output into its
arena are two more copies (the client reads the output in place).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from bench_timing import time_alternating, time_calls
from torchpool import Client

MiB = 1 << 20


def bench_local(url: str, n_small: int, n_big: int) -> dict:
    src = np.ones(4 * MiB, np.float32)
    dst = np.empty_like(src)
    dst[:] = 0                                            # pre-faulted, like the arenas
    memcpy = time_calls(lambda: np.copyto(dst, src), n_big * 2, 3)[0]
    a = np.ones((1, 16), np.float32)
    out: dict = {"memcpy_16MiB": memcpy}
    with Client(url, local=True) as local, Client(url, local=False) as inline:
        def call(c: Client, model: str, inputs: dict) -> Callable[[], None]:
            def run() -> None:
                with c.infer(model, inputs):              # outputs released at once
                    pass
            return run

        out["local_16MiB"] = time_calls(call(local, "identity", {"INPUT__0": src}), n_big, 3)
        assert local.is_local, "the client did not get a local session"
        out["inline_16MiB"] = time_calls(call(inline, "identity", {"INPUT__0": src}), n_big, 3)
        out["clone_local_16MiB"] = time_calls(call(local, "clone", {"INPUT__0": src}), n_big, 3)
        out["clone_inline_16MiB"] = time_calls(call(inline, "clone", {"INPUT__0": src}), n_big, 3)
        buf = local.empty((4 * MiB,), "FP32")
        buf[:] = 1.0
        before = local.transfer_stats()
        out["in_place_16MiB"] = time_calls(call(local, "identity", {"INPUT__0": buf}), n_big, 3)
        after = local.transfer_stats()
        runs = n_big + 3
        out["in_place_bytes_copied"] = after["bytes_copied"] - before["bytes_copied"]
        out["in_place_bytes_zero_copy"] = (after["bytes_zero_copy"] - before["bytes_zero_copy"]) // runs
        # alternated: the two differ by microseconds, less than this machine drifts
        out["local_tiny"], out["inline_tiny"] = time_alternating(
            call(local, "addsub", {"INPUT0": a, "INPUT1": a}), call(inline, "addsub", {"INPUT0": a, "INPUT1": a}),
            n_small, 20)
    return out


def render_local(r: dict, us: Callable[[float], str]) -> list[str]:
    two = 2 * r["memcpy_16MiB"]
    local, inline, in_place = r["local_16MiB"][0], r["inline_16MiB"][0], r["in_place_16MiB"][0]
    return [
        "", "Local shared-memory path (ipc, same host), p50 / p99, c=1:", "",
        "| case | p50 | p99 | vs two 16 MiB memcpys | vs inline frames |", "|---|---|---|---|---|",
        f"| two 16 MiB memcpys (floor) | {us(two)} | | 1.00x | |",
        f"| identity 16 MiB, local path (input copied once into the client arena, the output "
        f"comes back in that block) | {us(local)} "
        f"| {us(r['local_16MiB'][1])} | {local / two:.2f}x | {inline / local:.1f}x faster |",
        f"| identity 16 MiB, allocate in place (`c.empty`) | {us(in_place)} | {us(r['in_place_16MiB'][1])} "
        f"| {in_place / two:.2f}x | {inline / in_place:.1f}x faster |",
        f"| identity 16 MiB, inline frames | {us(inline)} | {us(r['inline_16MiB'][1])} | {inline / two:.2f}x | 1.0x |",
        f"| clone 16 MiB (a new output tensor: two more copies), local path | {us(r['clone_local_16MiB'][0])} "
        f"| {us(r['clone_local_16MiB'][1])} | {r['clone_local_16MiB'][0] / two:.2f}x "
        f"| {r['clone_inline_16MiB'][0] / r['clone_local_16MiB'][0]:.1f}x faster |",
        f"| clone 16 MiB, inline frames | {us(r['clone_inline_16MiB'][0])} | {us(r['clone_inline_16MiB'][1])} "
        f"| {r['clone_inline_16MiB'][0] / two:.2f}x | 1.0x |",
        f"| add/sub 2x[1,16], local session (calls alternated with inline) | {us(r['local_tiny'][0])} "
        f"| {us(r['local_tiny'][1])} | "
        f"| {r['inline_tiny'][0] / r['local_tiny'][0]:.2f}x |",
        f"| add/sub 2x[1,16], inline frames | {us(r['inline_tiny'][0])} | {us(r['inline_tiny'][1])} | | 1.0x |",
        "", f"allocate in place: {r['in_place_bytes_copied']} input bytes copied by the client over the run; "
            f"{r['in_place_bytes_zero_copy']:,} bytes passed by descriptor per request.",
    ]
