"""torchpool beside the servers people use today, in the same run (scripts/bench).

Runs the shared anchors (../shared/anchors/bench_all.py: the raw ZeroMQ echo,
the ZeroMQ-control + POSIX-shm floor, TorchServe 0.12 with and without
batching, PyTriton 0.7 over HTTP, and torchpool from this checkout with and
without dynamic batching) on the same TorchScript files: add/sub 2x[1,16],
an MLP 256-1024-1024-10 and a 12 MiB `x*1`; p50/p99 at c=1, CPU per request
of the client and every server process, throughput with 8 client processes.
It needs the anchors' virtual environments ($ANCHORS_VENV_ROOT, made by
../shared/anchors/setup_venvs.sh); without them the section says so and is
skipped. Its tables are the anchors' own report.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
ANCHORS_DIR = ROOT.parent / "shared" / "anchors"
SYSTEMS = "zmq_raw,shm_raw,torchserve_http,torchserve_http_b8,pytriton_http,torchpool,torchpool_b8"


def anchors_python() -> tuple[Optional[Path], str]:
    """(the anchors' base interpreter, "") or (None, why not)."""
    venvs = os.environ.get("ANCHORS_VENV_ROOT")
    if not venvs:
        return None, "ANCHORS_VENV_ROOT is not set (../shared/anchors/README.md)"
    py = Path(venvs) / "base" / "bin" / "python"
    if not py.exists():
        return None, f"{py} does not exist (run ../shared/anchors/setup_venvs.sh)"
    if not (ANCHORS_DIR / "bench_all.py").exists():
        return None, f"{ANCHORS_DIR}/bench_all.py does not exist"
    return py, ""


def bench_anchors(out_dir: Path, quick: bool) -> dict:
    """Run bench_all.py; {"results": path, "tables": markdown} or {"skipped": why}."""
    py, why = anchors_python()
    if py is None:
        return {"skipped": why}
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"anchors-{time.strftime('%Y%m%d-%H%M%S')}.json"
    cmd = [str(py), str(ANCHORS_DIR / "bench_all.py"), "--system", SYSTEMS, "--out", str(out)]
    if quick:
        cmd.append("--quick")
    # its torchpool systems serve from the working directory's checkout and .venv
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not out.exists():
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        return {"skipped": f"bench_all.py failed ({run.returncode}): " + " | ".join(tail)}
    tables = subprocess.run([str(py), str(ANCHORS_DIR / "report.py"), str(out)], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return {"results": str(out), "tables": tables, "figures": json.loads(out.read_text())}


def render_anchors(r: dict) -> list[str]:
    if "skipped" in r:
        return ["", f"servers side by side (anchors): skipped: {r['skipped']}"]
    return ["", "servers side by side, same models, same run (../shared/anchors, "
                f"raw figures {r['results']}):", "", r["tables"].rstrip()]
