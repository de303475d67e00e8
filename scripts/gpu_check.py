"""scripts/gpu-check: prepare here, run there (issue 30, item 7).

A GPU machine lent for a few minutes has its own python3 with a CUDA build
of torch (possibly older than this checkout's pin), no package index, and
none of pyzmq or posix_ipc. So the check is prepared here and run there as
one command:

- here (no flag): the wheels it lacks, for its Python (3.12, x86-64
  manylinux), are downloaded into `.gpu/wheels` (ignored by git through
  .git/info/exclude, carried by the device tool), and the one command to run
  there is printed;
- `--dry-run` (here): the same checks without running anything there: every
  wheel present, the command within the device tool's 2,000 characters, the
  GPU tests collected (and skipped: no CUDA here), the measurement script's
  CPU rehearsal (tiny sizes, `--cpu`);
- `--on-device` (there): the wheels installed into /tmp/site, the C
  extensions built in place for that Python (optional ones: a failure only
  loses the fast copies), `pytest tests/gpu`, then scripts/gpu_measure.py;
  the output goes to stdout and to $OUT.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_DIR = ROOT / ".gpu"
WHEELS = GPU_DIR / "wheels"
DEVICE_PYTHON = "3.12"              # the device image's python3 (../.library/device/KINDS.md)
# what the device lacks (pyzmq, posix_ipc) or may hold in another version (msgpack); the
# versions are this checkout's venv's, so both ends speak the same protocol library
PACKAGES = {"pyzmq": "27.3.0", "posix_ipc": "1.3.2", "msgpack": "1.2.4"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
DEVICE_COMMAND = "scripts/gpu-check --on-device"
DEVICE_TIMEOUT_S = 480              # the 8 minutes; the device tool allows 600 a command
COMMAND_LIMIT = 2000                # the device tool's limit on a command line


def wheel_of(package: str) -> list[Path]:
    stem = package.replace("-", "_")
    return sorted(WHEELS.glob(f"{stem}-{PACKAGES[package]}-*.whl"))


def fetch_wheels() -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)          # (.gitignore has /.gpu/: carried, never committed)
    for package, version in PACKAGES.items():
        if wheel_of(package):
            continue
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", DEVICE_PYTHON, "--implementation", "cp", "-d", str(WHEELS),
               f"{package}=={version}"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd, check=True)


def device_command() -> str:
    return f"set -o pipefail; PYTHONUNBUFFERED=1 {DEVICE_COMMAND} 2>&1 | tee $OUT/gpu-check.log"


def dry_run() -> int:
    problems = [f"no wheel of {p}=={v} in {WHEELS} (run scripts/gpu-check first)"
                for p, v in PACKAGES.items() if not wheel_of(p)]
    command = device_command()
    if len(command) > COMMAND_LIMIT:
        problems.append(f"the device command is {len(command)} characters (limit {COMMAND_LIMIT})")
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "tests/gpu"],
                               cwd=ROOT, capture_output=True, text=True)
    if collected.returncode != 0 or "test_" not in collected.stdout:
        problems.append(f"tests/gpu do not collect:\n{collected.stdout}{collected.stderr}")
    skipped = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=ROOT,
                             capture_output=True, text=True)
    if skipped.returncode != 0:
        problems.append(f"tests/gpu failed without a GPU (they must skip):\n{skipped.stdout[-2000:]}")
    rehearsal = subprocess.run([sys.executable, "scripts/gpu_measure.py", "--cpu", "--quick"], cwd=ROOT,
                               capture_output=True, text=True)
    if rehearsal.returncode != 0:
        problems.append(f"gpu_measure.py --cpu --quick failed:\n{rehearsal.stdout[-2000:]}{rehearsal.stderr[-2000:]}")
    for p in problems:
        print(f"gpu-check: {p}", file=sys.stderr)
    if not problems:
        print(f"gpu-check --dry-run: ready. On the GPU machine (device tool, carry [\".gpu\"], "
              f"timeout_s {DEVICE_TIMEOUT_S + 60}):\n  {command}")
        print(rehearsal.stdout.rstrip())
    return 1 if problems else 0


def on_device() -> int:
    out = Path(os.environ.get("OUT", "/tmp/gpu-check-out"))
    out.mkdir(parents=True, exist_ok=True)
    site = Path("/tmp/site")
    wheels = sorted(WHEELS.glob("*.whl"))
    if len(wheels) < len(PACKAGES):
        print(f"gpu-check: carry .gpu (its wheels): found {[w.name for w in wheels]}", file=sys.stderr)
        return 2
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), PYTHONUNBUFFERED="1")
    # the C extensions for this Python (all optional: a failure only loses the fast copies)
    built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    print(f"gpu-check: C extensions {'built' if built.returncode == 0 else 'not built'}", flush=True)
    info = subprocess.run([sys.executable, "-c", "import torch, zmq, posix_ipc, msgpack; "
                           "print('torch', torch.__version__, 'cuda', torch.version.cuda, "
                           "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU')"],
                          env=env, capture_output=True, text=True)
    print(info.stdout + info.stderr, flush=True)
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], check=False)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "300",
                            "tests/gpu", "--junitxml", str(out / "gpu-tests.xml")], cwd=ROOT, env=env)
    measured = subprocess.run([sys.executable, "scripts/gpu_measure.py", "--json", str(out / "gpu-measure.json")],
                              cwd=ROOT, env=env)
    print(f"gpu-check: tests rc {tests.returncode}, measurements rc {measured.returncode}")
    return tests.returncode or measured.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check the wiring here")
    mode.add_argument("--on-device", action="store_true", help="run on the GPU machine")
    args = parser.parse_args()
    if args.on_device:
        return on_device()
    if args.dry_run:
        return dry_run()
    fetch_wheels()
    print(f"wheels in {WHEELS}: {sorted(w.name for w in WHEELS.glob('*.whl'))}")
    print(f"on the GPU machine (device tool, carry [\".gpu\"], timeout_s {DEVICE_TIMEOUT_S + 60}):\n  "
          f"{device_command()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
