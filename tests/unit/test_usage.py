"""What a worker process uses, read from /proc (broker/usage.py): CPU and RSS at
once, PSS on the sampler's thread, never waited for."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

from torchpool.broker.usage import PssSampler, instance_row, instance_rows, read_pss, read_stat

from ..support.daemon import cpu_ticks, wait_for


def test_stat_and_pss_of_a_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b\"x\" * (64 << 20); print('filled', "
                              "flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # it says when its 64 MiB are written (RSS past 64 MiB came before the
        # last of them, on a loaded machine)
        assert child.stdout.readline() == b"filled\n"
        usage = read_stat(child.pid)
        assert abs(usage.cpu_seconds - cpu_ticks(child.pid) / os.sysconf("SC_CLK_TCK")) < 0.1
        pss = read_pss(child.pid)
        # its 64 MiB are its own (counted whole); the interpreter's shared pages only in part
        assert 64 << 20 < pss <= usage.rss_bytes
    finally:
        child.kill()
        child.wait()
    assert read_stat(child.pid) is None and read_pss(child.pid) is None      # gone: None, no error


def test_sampler_answers_at_once_and_reads_on_its_thread() -> None:
    sampler = PssSampler(every=0.05, forget_after=0.5)
    me = os.getpid()
    assert sampler.pss(me) is None                        # never read yet: not waited for
    first = wait_for(lambda: sampler.pss(me), 10, "the sampler's first reading")
    assert abs(first - read_pss(me)) < 32 << 20
    # read on demand only: with nobody asking, the thread reads nothing
    read_at = sampler._pss[me][0]
    time.sleep(0.2)                                       # (an interval with no asking: not a wait)
    assert sampler._pss[me][0] == read_at
    # asked again past `every`: answered at once with the old reading, read again
    assert sampler.pss(me) == first
    wait_for(lambda: sampler._pss[me][0] > read_at, 10, "a fresh reading")
    # nobody asks for longer than forget_after: the reading is dropped at the next read
    time.sleep(0.6)
    sampler.pss(os.getppid())
    wait_for(lambda: me not in sampler._asked, 10, "the sampler to forget an unasked pid")
    assert sampler.pss(me) is None


def test_rows_of_workers() -> None:
    now = time.monotonic()
    me = os.getpid()
    sampler = PssSampler(every=0.05)

    def handle(name: str, state: str, stopping: bool = False) -> SimpleNamespace:
        return SimpleNamespace(process=SimpleNamespace(pid=me),
                               spec=SimpleNamespace(instance=name, device="cpu", threads=1),
                               state=state, stopping=stopping, started=now - 12.5)

    row = instance_row(handle("m_0", "IDLE"), 2, now, sampler)
    assert row["name"] == "m_0" and row["pid"] == me and row["device"] == "cpu"
    assert row["state"] == "READY" and row["restarts"] == 2
    assert row["uptime_s"] == 12.5 and abs(row["started"] - (time.time() - 12.5)) < 1
    assert row["cpu_s"] > 0 and row["rss_bytes"] > 0 and row["pss_bytes"] is None
    rows = instance_rows([handle("m_1", "STARTING"), handle("m_0", "BUSY", stopping=True)], {"m_1": 3}, sampler)
    assert [(r["name"], r["state"], r["restarts"]) for r in rows] == [("m_0", "STOPPING", 0), ("m_1", "LOADING", 3)]

    class Closed:                     # multiprocessing.Process once closed (reaped)
        @property
        def pid(self) -> int:
            raise ValueError("process object is closed")
    gone = handle("m_2", "IDLE")
    gone.process = Closed()
    assert instance_rows([gone], {}, sampler) == []


def test_ps_shows_the_memory_of_now_not_of_the_previous_call() -> None:
    """`torchpool ps` (cli current_rows) asks again while a reading is older
    than the sampler's `every`: it showed the previous call's reading."""
    from torchpool.cli.client_commands import current_rows

    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; print('started', flush=True); sys.stdin.readline(); b = b'x' * (256 << 20); "
                              "print('grown', flush=True); sys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sampler = PssSampler(every=0.05)
        h = SimpleNamespace(process=child, spec=SimpleNamespace(instance="m_0", device="cpu", threads=1),
                            state="IDLE", stopping=False, started=time.monotonic())

        def fetch() -> list:
            return instance_rows([h], {}, sampler)

        assert child.stdout.readline() == "started\n"
        before = current_rows(fetch, every=0.05, wait=10)[0]
        assert before["pss_bytes"] is not None and before["pss_age_s"] <= 0.05
        child.stdin.write("grow\n")
        child.stdin.flush()
        assert child.stdout.readline() == "grown\n"
        time.sleep(0.1)       # the reading grows older than `every` (the time passing is the test)
        stale = fetch()[0]    # answered at once: the old reading, and its age
        assert stale["pss_age_s"] > 0.05
        now = current_rows(fetch, every=0.05, wait=10)[0]
        assert now["pss_age_s"] <= 0.05 and now["pss_bytes"] > stale["pss_bytes"] + (200 << 20), (stale, now)
    finally:
        child.kill()
        child.wait()
