#!/usr/bin/env bash
# Install the Debian/Ubuntu packages gpumode's test suite needs, and only those that are missing.
#   libvirt-dev, pkg-config, gcc, python3-dev: build libvirt-python (the libvirt tests use its test:///default driver)
#   python3-venv: scripts/test.sh creates .venv     pciutils: lspci, for comparing with a real host
#   chromium: the dashboard's browser tests (tests/web/test_browser.py drive it headless through Playwright)
#   systemd: systemd-analyze, which verifies deploy/systemd/ (tests/deploy/test_systemd.py)
#   openssl, curl, sqlite3, postgresql-client: docs/deploy.md's commands, run by tests/deploy/
# Quiet unless something fails; safe to run again and again.
set -euo pipefail

packages=(libvirt-dev pkg-config pciutils gcc python3-dev python3-venv chromium systemd openssl curl sqlite3 postgresql-client)

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

if ! command -v dpkg-query >/dev/null 2>&1; then
    # Not a Debian system: check what the build needs instead of installing it.
    if pkg-config --exists libvirt 2>/dev/null && command -v gcc >/dev/null 2>&1; then
        exit 0
    fi
    echo "install-system-deps: no dpkg/apt here; install the equivalents of: ${packages[*]}" >&2
    exit 1
fi

missing=()
for pkg in "${packages[@]}"; do
    installed "$pkg" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo -n)
else
    echo "install-system-deps: missing ${missing[*]}; run this script as root" >&2
    exit 1
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { "${as_root[@]}" apt-get update -q &&
       "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-system-deps: installing ${missing[*]} failed" >&2
    exit 1
fi
