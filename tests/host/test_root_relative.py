"""Paths in messages are shown from the host root, also when they were reached through a symlink."""

from __future__ import annotations

from pathlib import Path

from gpumode.host.root import Host


def test_a_resolved_path_under_a_symlinked_root_is_shown_from_the_root(tmp_path: Path) -> None:
    real = tmp_path / "real"
    dev = real / "sys/devices/pci0000:00/0000:00:01.0"
    dev.mkdir(parents=True)
    (real / "sys/bus/pci/devices").mkdir(parents=True)
    (real / "sys/bus/pci/devices/0000:00:01.0").symlink_to("../../../devices/pci0000:00/0000:00:01.0")
    (tmp_path / "link").symlink_to(real)
    host = Host(tmp_path / "link")
    resolved = host.path("sys/bus/pci/devices/0000:00:01.0/driver_override").resolve(strict=False)
    assert host.relative(resolved) == "sys/devices/pci0000:00/0000:00:01.0/driver_override"
    assert host.relative(host.path("sys/bus/pci/devices")) == "sys/bus/pci/devices"
    assert not host.relative(resolved).startswith("..")
