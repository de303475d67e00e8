#!/usr/bin/env python3
"""Soak: mixed load against a real daemon while workers are killed at random.

Every request must end in exactly one of: a correct answer, or an error that
names the crashed worker. A request with no answer within the client timeout
is lost; the run fails if any is lost or any answer is wrong. Bounded in time
(--duration) and traffic stays on this machine (an ipc:// socket).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from torchpool import Client, InferenceError, NoAnswer  # noqa: E402


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return found


def worker_pids(daemon_pid: int) -> list[int]:
    """Workers are the fork server's children; the fork server is the daemon's."""
    pids = []
    for child in children(daemon_pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd:
            pids += children(child)
    return pids


CASES = {
    "addsub": (lambda rng: {"INPUT0": rng.standard_normal((2, 16)).astype(np.float32),
                            "INPUT1": rng.standard_normal((2, 16)).astype(np.float32)},
               lambda i, o: np.allclose(o["OUTPUT0"], i["INPUT0"] + i["INPUT1"])
               and np.allclose(o["OUTPUT1"], i["INPUT0"] - i["INPUT1"])),
    "strings": (lambda rng: {"INPUT__0": [f"w{rng.integers(1000)}" for _ in range(3)]},
                lambda i, o: [s.decode() for s in o["OUTPUT__0"]] == [s.upper() for s in i["INPUT__0"]]),
    "dict_input": (lambda rng: {"x": np.full((1, 4), 2, np.float32),
                                "y": rng.standard_normal((1, 4)).astype(np.float32)},
                   lambda i, o: np.allclose(o["OUTPUT__0"], i["x"] * 2 + i["y"])),
    "identity": (lambda rng: {"INPUT__0": rng.standard_normal(int(rng.integers(1, 100_000))).astype(np.float32)},
                 lambda i, o: np.array_equal(o["OUTPUT__0"], i["INPUT__0"])),
}


def two_instances(repo: Path) -> None:
    """Give each model two instances so one survives while the other restarts."""
    for cfg in repo.glob("*/config.pbtxt"):
        text = cfg.read_text()
        if "instance_group" not in text:
            cfg.write_text(text + '\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills (default 2)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=30.0, help="a request unanswered this long is lost")
    args = parser.parse_args()

    from torchpool.examples import build_example_repository

    work = Path(tempfile.mkdtemp(prefix="torchpool-soak-"))
    repo = work / "repo"
    build_example_repository(repo)
    shutil.rmtree(repo / "mlp")                # keep the 2-core machine for the traffic
    two_instances(repo)
    url = f"ipc://{work}/soak.sock"
    log = open(work / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "torchpool", "serve", "--model-repository", str(repo),
                               "--listen", url], stdout=log, stderr=subprocess.STDOUT)
    counts: Counter = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def count(what: str) -> None:
        with lock:
            counts[what] += 1

    def client_loop(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(url, timeout=args.timeout) as c:
            while not stop.is_set():
                model = list(CASES)[int(rng.integers(len(CASES)))]
                make, check = CASES[model]
                inputs = make(rng)
                count("sent")
                try:
                    out = c.infer(model, inputs)
                except InferenceError as exc:
                    if exc.code == "INTERNAL" and "while running this request" in exc.message:
                        count("crash_error")
                    elif "no answer from torchpool" in exc.message:
                        count("lost")
                    else:
                        count("other_error")
                        print("unexpected error:", exc, file=sys.stderr)
                    continue
                count("answered" if check(inputs, out) else "wrong_answer")

    def killer() -> None:
        rng = random.Random(1)
        while not stop.wait(args.kill_every):
            pids = worker_pids(daemon.pid)
            if pids:
                victim = rng.choice(pids)
                try:
                    os.kill(victim, signal.SIGKILL)
                    count("workers_killed")
                except ProcessLookupError:
                    pass

    try:
        with Client(url, timeout=120) as c:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if c.server_ready(timeout=5):
                        break
                except NoAnswer:          # no socket file yet: the daemon is starting
                    time.sleep(0.1)
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
        threads.append(threading.Thread(target=killer))
        started = time.monotonic()
        for t in threads:
            t.start()
        while time.monotonic() - started < args.duration:
            time.sleep(min(10.0, args.duration))
            print(f"[{time.monotonic() - started:5.0f} s] {dict(counts)}", flush=True)
        stop.set()
        for t in threads:
            t.join(args.timeout + 10)
    finally:
        stop.set()
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
        log.close()
    left = [n for n in os.listdir("/dev/shm") if n.startswith("torchpool.") and f".{daemon.pid}." in n]
    restarts = (work / "daemon.log").read_text().count("restarting it")
    print("\nsoak result")
    for key in ("sent", "answered", "crash_error", "lost", "wrong_answer", "other_error", "workers_killed"):
        print(f"  {key:<15} {counts[key]}")
    print(f"  worker restarts logged {restarts}; daemon exit code {code}; segments left {len(left)}")
    ok = (counts["lost"] == 0 and counts["wrong_answer"] == 0 and counts["other_error"] == 0 and code == 0
          and not left and counts["sent"] == counts["answered"] + counts["crash_error"])
    print("PASS" if ok else "FAIL")
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"daemon log kept in {work / 'daemon.log'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
