"""scripts/gpu-check's wiring, here (issue 30, item 7): the one command for
the GPU machine fits the device tool, the wheels it carries are the versions
this checkout runs, and the measurement script's CPU rehearsal runs every
step (a daemon included) and reports each figure."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


def test_the_device_command_fits_and_the_wheels_match_this_checkouts_versions() -> None:
    command = gpu_check.device_command()
    assert len(command) <= gpu_check.COMMAND_LIMIT and "--on-device" in command and "$OUT" in command
    for package, version in gpu_check.PACKAGES.items():
        assert importlib.metadata.version(package) == version, package
    assert gpu_check.DEVICE_TIMEOUT_S + 60 <= 600          # the device tool's limit on one command


def test_the_measurements_rehearse_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "scripts/gpu_measure.py", "--cpu", "--quick", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["bandwidth"]["h2d_pageable_GBs"] > 0 and figures["bandwidth"]["d2h_pageable_GBs"] > 0
    trips = figures["round_trips"]
    assert trips["devices"] == {"identity": ["cpu"], "mlp": ["cpu"], "mlp_batched": ["cpu"]}
    assert trips["mlp_batched_c8_rps"] > 0 and trips["daemon_identity_p50_s"] > 0
