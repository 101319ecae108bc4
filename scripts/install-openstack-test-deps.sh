#!/usr/bin/env bash
# Real Nova and Cyborg for the tests marked `nova`, in a venv of their own: nova's pins (eventlet, oslo.*,
# SQLAlchemy) must not move gpumode's packages, and nova's global config stays out of gpumode's test process
# (tests/openstack/novarun.py runs each nova scenario as a subprocess of this venv's python).
# The venv lives in the cache dir and is rebuilt only when the pins below change; wheels are cached beside it,
# so a fresh machine installs once (a few minutes) and later runs take about a second.
# Prints the venv's python on success.
set -euo pipefail

pins=(
    "nova==34.0.0"
    "openstack-cyborg==17.0.0"
    "openstack-placement==16.0.0"
    # nova's functional harness (nova.test, nova/tests/fixtures) imports these test-only packages
    "fixtures" "testtools" "oslotest" "wsgi-intercept"
    "PyMySQL"  # nova-api's and Cyborg's databases on the MariaDB CI has
)

cache="${GPUMODE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpumode}"
venv="$cache/openstack-venv"
stamp="$venv/.pins"
want=$(printf '%s\n' "${pins[@]}")

if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "$venv/bin/python"
    exit 0
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
mkdir -p "$cache"
rm -rf "$venv"
"$python" -m venv "$venv"
log="$cache/openstack-venv-install.log"
if ! PIP_CACHE_DIR="$cache/pip" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "${pins[@]}" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "install-openstack-test-deps: pip install failed (full log: $log)" >&2
    rm -rf "$venv"
    exit 1
fi
printf '%s\n' "$want" >"$stamp"
echo "$venv/bin/python"
