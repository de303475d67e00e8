"""Output capture (torchpool.worker.capture, _outcapture.c): the region's
allocator on its own, then the libc10 hooks and the worker's lending rules.

Installing the hooks is once per process and for good, so every test that
installs them runs in a child interpreter (a hook that went wrong kills the
child, not pytest) that prints JSON.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_outcapture = pytest.importorskip("torchpool.worker._outcapture",
                                  reason="the _outcapture extension is not built")
Heap = _outcapture.Heap

ROOT = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20


# ------------------------------------------------------------ the allocator


def test_blocks_are_first_fit_and_rounded_to_cache_lines() -> None:
    heap = Heap(1 * MiB)
    assert heap.alloc(100) == 0
    assert heap.alloc(64) == 128                  # 100 bytes took two cache lines
    assert heap.alloc(1) == 192
    assert (heap.blocks, heap.used_bytes, heap.free_bytes) == (3, 256, 1 * MiB - 256)
    assert heap.free(128) is True
    assert heap.alloc(64) == 128                  # the first hole that fits
    assert heap.alloc(65) == 256                  # too big for any hole: after the last block


def test_freeing_merges_neighbours_in_any_order() -> None:
    heap = Heap(1 * MiB)
    offsets = [heap.alloc(64 * KiB) for _ in range(8)]
    assert offsets == [i * 64 * KiB for i in range(8)]
    for i in (1, 5, 3):
        assert heap.free(offsets[i]) is True
    assert heap.free_ranges == 4                  # three holes and the tail
    assert heap.free(offsets[2]) is True          # joins holes 1 and 3 into one
    assert heap.free(offsets[4]) is True          # ... and 5
    assert heap.free_ranges == 2
    assert heap.largest_free == 1 * MiB - 8 * 64 * KiB
    assert heap.alloc(5 * 64 * KiB) == offsets[1]  # the merged hole holds five blocks
    for offset in (offsets[0], offsets[1], offsets[6], offsets[7]):
        assert heap.free(offset) is True
    assert (heap.blocks, heap.used_bytes, heap.free_ranges, heap.largest_free) == (0, 0, 1, 1 * MiB)


def test_alignment_keeps_the_padding_free() -> None:
    heap = Heap(1 * MiB)
    assert heap.alloc(64) == 0
    assert heap.alloc(100, align=4096) == 4096
    assert heap.free_ranges == 2                  # [64, 4096) stays free, and the tail
    assert heap.alloc(4000) == 64                 # the padding is used later
    assert heap.alloc(64, align=1) == 4096 + 128  # below a cache line: a cache line
    assert heap.alloc(64, align=3) is None        # not a power of two
    assert heap.alloc(64, align=8192) is None     # more than the region's page alignment promises


def test_a_full_heap_says_none_and_takes_blocks_back() -> None:
    heap = Heap(256 * KiB, min_block=64 * KiB)
    assert [heap.alloc(64 * KiB) for _ in range(4)] == [0, 64 * KiB, 128 * KiB, 192 * KiB]
    assert heap.alloc(64) is None
    assert heap.alloc(0) is None
    assert heap.alloc(512 * KiB) is None
    assert heap.free(64 * KiB) is True
    assert heap.alloc(10) == 64 * KiB             # a small block still takes min_block
    assert heap.alloc(10) is None


def test_freeing_what_was_never_allocated_is_refused() -> None:
    heap = Heap(1 * MiB)
    start = heap.alloc(1000)
    assert heap.free(start + 64) is False         # inside a block, not its start
    assert heap.free(512 * KiB) is False          # free memory
    assert heap.free(-1) is False
    assert heap.free(start) is True
    assert heap.free(start) is False              # twice
    assert heap.used_bytes == 0


def test_random_allocations_never_overlap_and_all_come_back() -> None:
    rng = random.Random(14)
    size = 4 * MiB
    heap = Heap(size, min_block=4 * KiB)
    live: dict[int, int] = {}
    for _ in range(4000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            assert heap.free(start) is True
            del live[start]
        else:
            n = rng.choice([4 * KiB, 10_000, 64 * KiB, 300 * KiB, 1 * MiB])
            align = rng.choice([64, 256, 4096])
            start = heap.alloc(n, align=align)
            if start is None:
                continue
            assert start % align == 0 and start + n <= size
            live[start] = max(n, 4 * KiB)
        ranges = sorted(live.items())
        assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:])), "blocks overlap"
        assert heap.blocks == len(live)
    for start in list(live):
        assert heap.free(start) is True
    assert (heap.used_bytes, heap.free_ranges, heap.largest_free) == (0, 1, size)


def test_bad_arguments_are_errors() -> None:
    with pytest.raises(ValueError):
        Heap(10)
    with pytest.raises(ValueError):
        Heap(1 * MiB).alloc(-1)


# ------------------------------------------------------------ the hooks, in a child
#
# One child interpreter runs every scenario in turn on one region (each
# leaves it empty) and prints what it saw: importing torch is most of a
# child's cost on a busy machine. The script is a file, so TorchScript can
# read the source of the models it defines.

HOOKED = textwrap.dedent("""
    import json, mmap, os, threading
    import torch
    from torchpool.worker import _outcapture as oc
    from torchpool.worker.capture import OutputCapture

    MiB = 1 << 20
    seen = {}
    announced = []
    capture = OutputCapture.create("capture-unit-test", announced.append, 30 * MiB)
    buf_size = capture.size

    def inside(t):
        return 0 <= t.data_ptr() - capture.base < buf_size

    # 1. large tensors made while capturing land in the region, and come back
    before = torch.ones(4 * MiB)                # not capturing: the heap
    capture.on()
    big = torch.full((4 * MiB,), 3.0)           # 16 MiB
    small = torch.ones(16)                      # under the threshold
    capture.off()
    seen["placement"] = {"used": list(capture.stats()), "where": [inside(before), inside(big), inside(small)],
                         "sum": float(big.sum())}
    del big
    seen["placement"]["after"] = list(capture.stats())

    # 2. intermediates go back; when the region is full, the heap
    class Chain(torch.nn.Module):
        def forward(self, x):
            return (x * 2 + 1) * 3              # two intermediates, freed as it goes

    chain = torch.jit.script(Chain())
    x = torch.ones(3, 1024, 1024)               # 12 MiB
    with torch.inference_mode():
        capture.on()
        outs = [chain(x), chain(x), chain(x)]
        capture.off()
    seen["full"] = {"where": [inside(t) for t in outs], "stats": list(capture.stats()),
                    "values": [float(t[0, 0, 0]) for t in outs]}
    del outs
    seen["full"]["after"] = list(capture.stats())[:2]

    # 3. threads allocate and free at once
    failures = []

    def work(seed):
        try:
            for i in range(100):
                t = torch.full((65536 * (1 + (seed + i) % 8),), float(seed))
                if float(t[-1]) != seed:
                    failures.append(seed)
        except Exception as exc:
            failures.append(repr(exc))

    capture.on()
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    capture.off()
    seen["threads"] = {"failures": failures, "after": list(capture.stats())[:2]}

    # 4. only tensors nobody else holds are lent
    class Keeper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.last = torch.zeros(0)

        def forward(self, x):
            y = x + 1
            self.last = y                       # the model keeps what it returns
            return y

    keeper = torch.jit.script(Keeper())
    with torch.inference_mode():
        capture.on()
        alone = torch.ones(MiB)
        held_by_model = keeper(torch.ones(MiB))
        base = torch.ones(MiB)
        view = base[: MiB // 2]                 # shares its memory with another tensor
        small = torch.ones(16)
        capture.off()
    lent = capture.lend(alone)
    seen["lend"] = {"announced": [s.name for s in announced],
                    "lent": None if lent is None else [lent[0], lent[2]],
                    "twice": capture.lend(alone), "held_by_model": capture.lend(held_by_model),
                    "base": capture.lend(base), "view": capture.lend(view), "small": capture.lend(small),
                    "used": capture.stats()[0]}
    del alone
    seen["lend"]["while_lent"] = capture.stats()[0]
    capture.release(lent[1])
    seen["lend"]["released"] = capture.stats()[0]
    del held_by_model, keeper, base, view

    # 5. installing is once; a forked child never captures (the region's pages are shared)
    try:
        oc.install(256 << 10)
        seen["again"] = "installed twice"
    except RuntimeError as exc:
        seen["again"] = str(exc)
    capture.on()
    kept = torch.empty(MiB)
    capture.off()
    kept[0], kept[-1] = 1.0, 2.0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                # no parallel kernels here: OpenMP is not fork-safe
        try:
            capture.on()
            refused = False
        except RuntimeError:
            refused = True
        fresh = torch.empty(MiB)
        ok = refused and not inside(fresh) and (float(kept[0]), float(kept[-1])) == (1.0, 2.0)
        del kept                                # only the child's copy of the bookkeeping
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    seen["fork"] = {"child_ok": os.read(read, 1) == b"1", "parent": list(capture.stats())[:2]}
    del kept

    # 6. more regions: capturing goes to the one chosen, each free to its own region
    from torchpool.shm.segment import Segment
    from torchpool.worker.capture import CaptureRegion
    other = CaptureRegion(Segment.create("capture-unit-test-2", 16 * MiB, prefault=False, only_we_write=True))
    capture.on(other)
    in_other = torch.full((MiB,), 5.0)
    capture.on()
    in_own = torch.full((MiB,), 6.0)
    capture.off()
    seen["regions"] = {"where": [0 <= in_other.data_ptr() - other.base < other.size, inside(in_own)],
                       "blocks": [other.blocks(), capture.stats()[1]]}
    written = other.alloc(300 << 10)
    seen["regions"]["written"] = [written is not None, other.blocks()]
    seen["regions"]["close_in_use"] = other.close()
    lent = other.lend(in_other)
    del in_other, in_own
    seen["regions"]["after_free"] = [other.blocks(), capture.stats()[1]]
    seen["regions"]["release"] = [other.release(lent[1]), other.release(written), other.release(12345)]
    seen["regions"]["close"] = [other.blocks(), other.close()]
    try:
        capture.on(other)
        seen["regions"]["capture_closed"] = "captured into a closed region"
    except ValueError as exc:
        seen["regions"]["capture_closed"] = str(exc)
    extra = []
    try:
        for i in range(70):
            extra.append(oc.add_region(mmap.mmap(-1, 1 << 16), 4096))
        seen["regions"]["full"] = "no limit"
    except RuntimeError as exc:
        seen["regions"]["full"] = [str(exc), len(extra)]
    seen["regions"]["removed"] = all(oc.remove_region(i) for i in extra)
    print(json.dumps(seen))
    """)


@pytest.fixture(scope="module")
def hooked(tmp_path_factory: pytest.TempPathFactory) -> dict:
    script = tmp_path_factory.mktemp("capture") / "hooked.py"
    script.write_text(HOOKED)
    # a script's own directory comes first on its path, not the cwd: this checkout's
    # torchpool, not the one the virtual environment installed
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"the child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_large_tensors_made_while_capturing_land_in_the_region_and_come_back(hooked: dict) -> None:
    seen = hooked["placement"]
    assert seen["where"] == [False, True, False]
    assert seen["used"][:2] == [16 * MiB, 1]
    assert seen["sum"] == 3.0 * 4 * MiB
    assert seen["after"] == [0, 0, 0]


def test_intermediates_go_back_and_a_full_region_falls_back_to_the_heap(hooked: dict) -> None:
    seen = hooked["full"]
    # the first two outputs fit beside one intermediate; the third finds 6 of 30 MiB free
    assert seen["where"] == [True, True, False]
    used, blocks, misses = seen["stats"]
    assert (used, blocks) == (24 * MiB, 2) and misses >= 3
    assert seen["values"] == [9.0, 9.0, 9.0]
    assert seen["after"] == [0, 0]


def test_threads_allocate_and_free_at_once(hooked: dict) -> None:
    assert hooked["threads"] == {"failures": [], "after": [0, 0]}


def test_only_tensors_nobody_else_holds_are_lent(hooked: dict) -> None:
    seen = hooked["lend"]
    assert seen["announced"] == ["capture-unit-test"]
    assert seen["lent"] == ["capture-unit-test", 4 * MiB]
    assert seen["twice"] is None                   # already lent
    assert seen["held_by_model"] is None           # the model may change it later
    assert seen["base"] is None and seen["view"] is None   # they share memory
    assert seen["small"] is None                   # on the heap
    assert seen["used"] == seen["while_lent"] == 3 * 4 * MiB
    assert seen["released"] == 2 * 4 * MiB         # the model's and base's are still alive


def test_capture_goes_to_the_chosen_region_and_frees_to_its_own(hooked: dict) -> None:
    seen = hooked["regions"]
    assert seen["where"] == [True, True]
    assert seen["blocks"] == [1, 1]
    assert seen["written"] == [True, 2]                 # a block Python writes an output into
    assert seen["close_in_use"] is False                # never unmapped under a tensor
    assert seen["after_free"] == [2, 0]                 # the lent one and the written block stay
    assert seen["release"] == [True, True, False]
    assert seen["close"] == [0, True]
    assert "no capture region" in seen["capture_closed"]
    message, added = seen["full"]
    assert "full" in message and added == 64 - 1        # the own region holds one slot


def test_install_is_once_and_a_forked_child_never_captures(hooked: dict) -> None:
    assert "already installed" in hooked["again"]
    assert hooked["fork"] == {"child_ok": True, "parent": [4 * MiB, 1]}


def test_the_environment_gives_the_default_size_or_turns_capture_off() -> None:
    """TORCHPOOL_OUTPUT_CAPTURE_MIB: the default of --output-capture-mib (compatibility)."""
    from torchpool.worker.capture_size import DEFAULT_MIB, capture_mib_from_environment

    assert capture_mib_from_environment({}) == DEFAULT_MIB
    assert capture_mib_from_environment({"TORCHPOOL_OUTPUT_CAPTURE_MIB": "0"}) == 0
    assert capture_mib_from_environment({"TORCHPOOL_OUTPUT_CAPTURE_MIB": " 32 "}) == 32
    assert capture_mib_from_environment({"TORCHPOOL_OUTPUT_CAPTURE_MIB": "lots"}) == DEFAULT_MIB
    assert capture_mib_from_environment({"TORCHPOOL_OUTPUT_CAPTURE_MIB": "-1"}) == DEFAULT_MIB


def test_without_the_extension_or_with_capture_off_there_is_no_region(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchpool.worker import capture

    announced: list = []
    assert capture.OutputCapture.create("off", announced.append, 0) is None
    monkeypatch.setattr(capture, "_outcapture", None)        # as on an install without a C compiler
    assert capture.OutputCapture.create("unbuilt", announced.append, 16 * MiB) is None
    assert announced == []                                    # the worker copies every output
