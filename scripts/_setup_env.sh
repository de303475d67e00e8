# Sourced by scripts/run, scripts/test and scripts/bench: make .venv and
# install torchpool into it if anything is missing. torch is pinned through
# constraints.txt so pip never resolves a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "torchpool: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
stamp="$VENV/.torchpool-installed"
# setup.py and the C sources are in the stamp: a change rebuilds the extensions
want="$(cat "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/constraints.txt" "$ROOT"/torchpool/*/_*.c | sha1sum | cut -c1-40)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c "import torchpool, torch, zmq, msgpack, posix_ipc, pytest" 2>/dev/null; then
  echo "torchpool: installing into $VENV (torch pinned by constraints.txt)" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" "torch==2.13.0"
  "$PY" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
