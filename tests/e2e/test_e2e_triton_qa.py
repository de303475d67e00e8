"""End to end: scripts/triton-qa's wiring of Triton's own QA files against a real
daemon: two runs of qa/L0_shared_memory (one per client type, each a fresh
daemon with --allow-client-shm=true, as test.sh makes them), on ports other than
Triton's. Needs a copy of Triton's server repository: TRITON_SERVER_REPO, or
the bare mirror this project's machines keep; skipped without one. The full
suites take minutes and are run by hand (docs/triton-qa.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..support.daemon import free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
MIRROR = Path("/work/.mirror/triton-inference-server+server/repo")
TRITON = Path(os.environ.get("TRITON_SERVER_REPO", MIRROR))

pytest.importorskip("tritonclient.grpc")
if not ((TRITON / "qa").is_dir() or (TRITON / "HEAD").is_file()):
    pytest.skip(f"no copy of Triton's server repository at {TRITON} (set TRITON_SERVER_REPO)",
                allow_module_level=True)


def test_shared_memory_runs_pass_on_fresh_daemons_away_from_tritons_ports(tmp_path: Path) -> None:
    # other ports than 8000/8001: the QA files' hardcoded ports are moved in the copy
    http_port, grpc_port = free_tcp_port(), free_tcp_port()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "triton_qa.py"), "--triton-server", str(TRITON),
                        "--suite", "L0_shared_memory", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                        "--test", "test_reregister_after_register.http", "--test", "test_mixed_raw_shm.grpc",
                        "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    lines = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.startswith("test_")}
    # name, ran, expected, passed, failed, errors, skipped, requests (the daemon answered)
    assert lines["test_reregister_after_register.http"][1:8] == ["1", "1", "1", "0", "0", "0", "0"]
    assert lines["test_mixed_raw_shm.grpc"][1:8] == ["1", "1", "1", "0", "0", "0", "1"]
    assert "runs: 2, passed 2, failed 0; tests: 2, passed 2" in r.stdout
    # each run had its own daemon, with the test's client type and client shared memory allowed
    daemons = sorted(p.name for p in tmp_path.glob("torchpool.*.log"))
    assert daemons == ["torchpool.test_mixed_raw_shm.grpc.log", "torchpool.test_reregister_after_register.http.log"]
