# Sourced by scripts/run, scripts/test and scripts/bench: make .venv and
# install torchpool into it (editable, with the server, test and plot extras)
# if anything is missing. torch is pinned through constraints.txt and
# installed first, so pip never resolves a bare `torch` (a multi-GB CUDA build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "torchpool: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
stamp="$VENV/.torchpool-installed"
# The packaging files and the C sources are in the stamp: a change to the
# dependencies reinstalls, a change to an extension rebuilds it.
want="$(cat "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/constraints.txt" \
             "$ROOT"/torchpool/*/_*.c | sha1sum | cut -c1-40)"
# Every module of the extras is checked, not only torch: a machine whose venv
# predates an added dependency (uvloop once) must reinstall, not fail in CI.
# matplotlib is looked up, not imported: its first import builds a font cache.
check='import torchpool, torch, zmq, msgpack, posix_ipc, httptools, grpc, google.protobuf, uvloop, setproctitle
import pytest, tritonclient.http, tritonclient.grpc, prometheus_client, kubernetes_validate, yaml, mypy, ruff
import importlib.util; assert importlib.util.find_spec("matplotlib"), "matplotlib is missing"'
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c "$check" 2>/dev/null; then
  echo "torchpool: installing into $VENV (torch pinned by constraints.txt)" >&2
  # the pin is constraints.txt's; torch first, alone, so nothing else picks its build
  torch_pin="$(grep -E '^torch==' "$ROOT/constraints.txt")" || {
    echo "torchpool: constraints.txt pins no torch (torch==X.Y.Z); refusing a bare torch resolve" >&2; exit 1; }
  "$PY" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" "$torch_pin"
  "$PY" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" -e "$ROOT[server,test,plot]"
  # fail here, naming the module, rather than in the middle of the suite
  "$PY" -c "$check"
  echo "$want" > "$stamp"
fi
