#!/usr/bin/env bash
# The whole check, from a fresh clone: system packages, .venv with gpumode[dev], ruff, mypy, pytest.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -k bind). Exit status: pytest's; "no tests" is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-system-deps.sh
# the `kernel` tests' QEMU, Debian kernel, sample mdev drivers and virtme-ng (under .cache/kernel/)
./scripts/install-kernel-test-deps.sh

if [ ! -x .venv/bin/python ]; then
    python=${PYTHON:-python3.11}
    command -v "$python" >/dev/null 2>&1 || python=python3
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
        echo "test.sh: gpumode needs Python 3.11 or newer ($python is $("$python" -V 2>&1))" >&2
        exit 1
    }
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'

# Real nova-compute and Cyborg for the tests marked `nova`, in a venv of their own (nova's pins stay out of
# .venv), kept in the cache dir: a fresh machine installs it once (about 2 minutes), later runs reuse it.
GPUMODE_NOVA_PYTHON=$(./scripts/install-openstack-test-deps.sh)
export GPUMODE_NOVA_PYTHON

.venv/bin/ruff check
.venv/bin/mypy

# The tests build thousands of small sysfs files per emulated host: on tmpfs that is about twice as fast as on
# ext4. A passing run deletes its temporary files (tmp_path_retention_policy in pyproject.toml).
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
    export TMPDIR=/dev/shm
fi

# PostgreSQL on 127.0.0.1:5432 is part of the check (CI has it): unreachable, its tests fail rather than skip.
# GPUMODE_REQUIRE_POSTGRES=0 turns that back into skipping, on a machine without it.
export GPUMODE_REQUIRE_POSTGRES="${GPUMODE_REQUIRE_POSTGRES:-1}"

# pytest collects only tests/ (testpaths in pyproject.toml): the bench scripts stay out of the test run.
status=0
.venv/bin/pytest -q "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$status"
