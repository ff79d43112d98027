#!/usr/bin/env bash
# The Debian packages some tests start for real: redis-server (tests/kv/test_redis_tier.py),
# prometheus and its promtool (tests/server/test_prometheus.py) and chromium (tests/server/test_web_ui.py).
# `make test` runs this first: as root (or with password-less sudo) it installs what is missing with
# apt-get; otherwise, or where apt-get fails, it prints one line naming the command, and those tests
# skip with their reason. KVSERVE_TEST_DEPS=0 skips this step.
set -uo pipefail
[ "${KVSERVE_TEST_DEPS:-1}" = 0 ] && exit 0

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
[ ${#missing[@]} = 0 ] && exit 0

hint="make test: ${missing[*]} not installed, so their tests will skip; to run them: apt-get install ${missing[*]} (as root)"
if [ "$(id -u)" = 0 ]; then SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=(sudo -n)
else echo "$hint" >&2; exit 0
fi
command -v apt-get >/dev/null || { echo "$hint" >&2; exit 0; }

export DEBIAN_FRONTEND=noninteractive
echo "make test: installing ${missing[*]} with apt-get (Debian packages the tests start on 127.0.0.1)" >&2
# prometheus without its recommends (node-exporter and friends would start more services); the others
# with theirs (chromium's fonts)
install() {
  local plain=() bare=()
  for p in "${missing[@]}"; do if [ "$p" = prometheus ]; then bare+=("$p"); else plain+=("$p"); fi; done
  { [ ${#plain[@]} = 0 ] || "${SUDO[@]}" apt-get install -y -q "${plain[@]}" >/dev/null 2>&1; } &&
  { [ ${#bare[@]} = 0 ] || "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${bare[@]}" >/dev/null 2>&1; }
}
# a fresh machine's package lists may be missing or stale: update once and retry
install || { "${SUDO[@]}" apt-get update -q >/dev/null 2>&1 && install; } || { echo "$hint" >&2; exit 0; }
# the packages start their own services (redis on 6379, prometheus on 9090); the tests start their own
for service in redis-server prometheus; do
  "${SUDO[@]}" service "$service" stop >/dev/null 2>&1 || true
done
exit 0
