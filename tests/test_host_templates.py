"""The copies ``tests/host_templates.py`` hands out share the kernel's files with their template by hard
links; that is only safe because nothing writes through those files. Switching a copy through every mode
and rebooting it must leave the template, and a sibling copy, byte for byte and mode for mode as they were.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from gpumode.domain import Mode, SwitchRequest
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.mini import T4, mini_host
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.modes import engine
from host_templates import HostTemplates

SPEC = mini_host("none", T4, gpus=2)
KEY = "mini-t4-none-2"


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``root``: its content (bytes, link target or "dir") and its permission bits."""
    out: dict[str, tuple[str, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                what = "link:" + os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                what = "dir"
            else:
                with open(path, "rb") as fh:
                    what = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.relpath(path, root)] = (what, stat.S_IMODE(st.st_mode))
    return out


def test_a_copy_shares_only_the_kernel_files(host_templates: HostTemplates, tmp_path: Path) -> None:
    copy = host_templates.host(SPEC, tmp_path / "copy", KEY)
    template = host_templates.template(KEY, lambda root: create_host(SPEC, root))
    assert snapshot(copy.root) == snapshot(template)
    shared = {"sys": 0, "proc": 0}
    for rel, _ in snapshot(template).items():
        mine, theirs = copy.root / rel, template / rel
        if mine.is_symlink() or not mine.is_file():
            continue
        top = rel.split(os.sep, 1)[0]
        if top in shared:
            assert os.path.samefile(mine, theirs), rel
            shared[top] += 1
        else:
            assert not os.path.samefile(mine, theirs), f"{rel} is shared but userspace writes it in place"
    assert all(shared.values()), shared  # the kernel's files really are hard links


def test_switching_a_copy_leaves_the_template_and_its_siblings_alone(
    host_templates: HostTemplates, tmp_path: Path
) -> None:
    host = host_templates.host(SPEC, tmp_path / "busy", KEY)
    sibling = host_templates.host(SPEC, tmp_path / "sibling", KEY)
    template = host_templates.template(KEY, lambda root: create_host(SPEC, root))
    before = snapshot(template)
    assert snapshot(sibling.root) == before

    vgpu = SwitchRequest(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    for request in (SwitchRequest(Mode.PASSTHROUGH), vgpu, SwitchRequest(Mode.ACCEL), vgpu):
        result = engine.apply(host, request)  # modules, packages, bindings, mdevs, driverctl, services
        assert result.ok, request
    EmulatedKernel(host.root).reboot()

    changed = snapshot(host.root)
    assert changed != before  # the copy did change, in sys/ too
    assert {k for k in changed.keys() ^ before.keys() if k.startswith("sys" + os.sep)}
    assert snapshot(template) == before
    assert snapshot(sibling.root) == before


def test_a_write_through_a_shared_file_would_reach_the_template(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Why only the kernel's files are shared: hard links carry every in-place write to the template (this
    copy comes from a private template, so the damage stays here)."""
    private = HostTemplates(tmp_path_factory)
    copy = private.host(SPEC, tmp_path / "copy", KEY)
    template = private.template(KEY, lambda root: create_host(SPEC, root))
    with open(copy.root / "proc" / "cmdline", "a") as fh:
        fh.write(" written-in-place")
    assert "written-in-place" in (template / "proc" / "cmdline").read_text()
