"""Property: whatever a host's files contain, discovery returns a snapshot (problems named), never raises."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_discover import datacenter_host, passthrough_host
from test_discover_tree import SysTree

from gpumode.host.discover import discover

UUID = "4b3c1a0e-5f6d-4e7a-8b9c-0d1e2f3a4b5c"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """Three hosts with every kind of file discovery reads, and each one's entries (files and links)."""
    root = tmp_path_factory.mktemp("garbage-base")
    datacenter_host(root / "dc")
    passthrough_host(root / "pt")
    t = SysTree(root / "vgpu")
    t.host()
    t.function("0000:3b:00.0", 0x10DE, 0x1EB8, 0x030200, group=5, driver="nvidia")
    t.mdev_type("0000:3b:00.0", "nvidia-222", "GRID T4-1Q", 14)
    t.mdev("0000:3b:00.0", UUID, "nvidia-222")
    t.function("0000:41:00.0", 0x10DE, 0x26B9, 0x030200, group=50, driver="nvidia")
    t.sriov("0000:41:00.0", 4, ["0000:41:00.4", "0000:41:00.5"], vf_driver="nvidia", first_group=51)
    t.vendor_vgpu("0000:41:00.4", {1147: "NVIDIA L40S-1Q"}, 1147)
    t.modules("nvidia", "nvidia_vgpu_vfio")
    t.nvidia_version("550.127.06")
    t.packages(("nvidia-vgpu-ubuntu-550", "550.127.06"))
    entries = {
        host: sorted(
            str(Path(d, name).relative_to(root / host))
            for d, dirs, files in os.walk(root / host)
            for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]
        )
        for host in ("dc", "pt", "vgpu")
    }
    return root, entries


garbage = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=120),
    st.sampled_from(
        ["", "\n", "(null)", "-1", "0x", "0xzz", "99999999999999999999", "ID : \n1 :", "\x00\xff"]
    ),
)
action = st.sampled_from(["write", "delete", "to_dir", "to_dangling_link", "to_self_link"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    host=st.sampled_from(["dc", "pt", "vgpu"]),
    changes=st.lists(st.tuples(st.integers(min_value=0), action, garbage), min_size=1, max_size=8),
)
def test_garbage_never_crashes_discovery(
    base: tuple[Path, dict[str, list[str]]], host: str, changes: list[tuple[int, str, bytes | str]]
) -> None:
    root, all_entries = base
    entries = all_entries[host]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "host"
        # hard links keep the copy cheap; every change below unlinks before writing, so the base stays intact
        shutil.copytree(root / host, copy, symlinks=True, copy_function=os.link)
        for index, what, payload in changes:
            path = copy / entries[index % len(entries)]
            if not os.path.lexists(path):
                continue  # an earlier change removed it (or its directory)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            data = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else payload
            if what == "write":
                path.write_bytes(data)
            elif what == "to_dir":
                path.mkdir()
            elif what == "to_dangling_link":
                path.symlink_to("../../no/such/" + (data.hex()[:20] or "x"))
            elif what == "to_self_link":
                path.symlink_to(path.name)  # a symlink loop: ELOOP on every open
        snap = discover(copy)
        assert snap.fingerprint == snap.compute_fingerprint()
        json.loads(snap.to_json())  # always serializable
        for problem in snap.problems:
            assert isinstance(problem, str) and problem
