#!/usr/bin/env bash
# The suite as a machine without the Debian test packages runs it: redis-server, redis-cli, prometheus,
# promtool and chromium hidden from the PATH (a copy of each PATH folder without them), then the tests
# that use them: every test module that names one of those programs, or imports a tests/ helper that
# does, with its tests marked `component` (pytest -m component; a module that names one and marks
# none fails here first). Fails on any error or failure, and unless each hidden component's tests
# skipped with their reason: a fixture that still reaches for a missing binary errors, and a skip that
# did not happen means the hiding did not work. (make test runs everything else, with the packages.)
# Usage: scripts/test_bare.sh [PYTHON]   (default: .venv/bin/python); extra pytest arguments in PYTEST_ARGS
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d /tmp/kvserve-bare.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

HIDDEN=" redis-server redis-cli prometheus promtool chromium chromium-browser "
bare_path=""
i=0
IFS=: read -ra dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
  [ -d "$dir" ] || continue
  i=$((i + 1)); mkdir "$WORK/path$i"
  for f in "$dir"/*; do
    name=${f##*/}
    [[ $HIDDEN == *" $name "* ]] || ln -s "$f" "$WORK/path$i/$name" 2>/dev/null || true
  done
  bare_path+="${bare_path:+:}$WORK/path$i"
done
for name in $HIDDEN; do
  if PATH=$bare_path command -v "$name" >/dev/null; then echo "test_bare: $name is still on the PATH"; exit 1; fi
done

cd "$ROOT"
# the test modules that name a hidden program (quoted, as a which() or a command line does), and those
# importing a helper module in tests/ that does (redis_server.py)
NAMED="[\"'](${HIDDEN// /|})[\"']"
NAMED=${NAMED//(|/(}; NAMED=${NAMED//|)/)}
mapfile -t files < <({
  grep -rlE --include='test_*.py' "$NAMED" tests
  for helper in $(grep -lE "$NAMED" tests/*.py | grep -v '/test_'); do
    grep -rlE --include='test_*.py' "^(from|import) $(basename "$helper" .py)\b" tests
  done; } | sort -u)
[ ${#files[@]} -gt 0 ] || { echo "test_bare: no test module names$HIDDEN"; exit 1; }
for f in "${files[@]}"; do
  grep -q "mark\.component" "$f" || { echo "test_bare: $f uses a Debian test program: mark its tests @pytest.mark.component"; exit 1; }
done
echo "test_bare: the component tests of ${#files[@]} modules with${HIDDEN% } hidden from the PATH"
set +e
env -u KVSERVE_CHROMIUM PATH="$bare_path" "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml="$WORK/junit.xml" \
  --basetemp="$WORK/tmp" -m component "${files[@]}" ${PYTEST_ARGS:-} 2>&1 | tee "$WORK/pytest.log"
code=${PIPESTATUS[0]}
set -e
"$PY" - "$WORK/junit.xml" "$code" "$WORK/pytest.log" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "errors", "failures", "skipped")}
# the skip reasons: the tests' (junit) and a whole module's (only in pytest's -rs summary)
skips = " ".join(e.get("message", "") for e in root.iter("skipped")) + open(sys.argv[3]).read()
expected = {"redis-server": "no redis-server", "prometheus": "no prometheus", "promtool": "no promtool",
            "chromium": "no chromium"}
missing = [name for name, reason in expected.items() if reason not in skips]
print(f"test_bare: {count['tests']} tests, {count['errors']} errors, {count['failures']} failures, "
      f"{count['skipped']} skipped")
if count["errors"] or count["failures"] or int(sys.argv[2]) != 0:
    sys.exit("test_bare: errors or failures without the Debian packages (pytest exited %s)" % sys.argv[2])
if missing:
    sys.exit(f"test_bare: no test skipped for want of {', '.join(missing)}: were they hidden?")
PYEOF
