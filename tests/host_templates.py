"""Emulated hosts for tests: each kind is built once per test session, then every test gets its own copy.

Building a host takes 0.2–6 s on ext4 (thousands of small sysfs files); a copy costs a fraction of that.
The templates live under pytest's ``tmp_path_factory``, so they go where pytest's other temporary
directories go and are removed by pytest's retention, never left behind in /tmp.

A copy hard-links the files under :data:`SHARED` (``sys/``, ``proc/``): only the emulated kernel writes there,
and it never writes through a file — :func:`gpumode.emulated.sysfs.apply` unlinks a file and creates a
new one — so a change to a copy cannot reach the template or another copy (``tests/test_host_templates.py``
proves it). Everything else is copied byte for byte: userspace and gpumode rewrite some of those files in
place (``Path.write_text`` on modules.dep, driverctl and mdevctl files; the emulated command log is appended
to), and the emulated kernel's lock file must not be one inode shared by every host.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpumode.emulated.spec import HostSpec
from gpumode.host.root import Host

SHARED = ("sys", "proc")


class HostTemplates:
    """Templates built on first use under one session's temporary directory, copied on demand."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._built: dict[str, Path] = {}

    def template(self, key: str, build: Callable[[Path], object]) -> Path:
        """The template called ``key``, made by ``build(root)`` the first time it is asked for."""
        root = self._built.get(key)
        if root is None:
            root = self._factory.mktemp(f"template-{key}", numbered=True) / "host"
            build(root)
            self._built[key] = root
        return root

    def copy(self, key: str, build: Callable[[Path], object], directory: Path) -> Path:
        """A private copy of template ``key`` at ``directory`` (which must not exist yet)."""
        return copy_host(self.template(key, build), directory)

    def host(self, fixture: str | HostSpec, directory: Path, key: str | None = None) -> Host:
        """A fresh whole emulated host (``create_host``) of ``fixture`` at ``directory``; a spec needs
        ``key`` unless its name says everything that differs between the specs a session uses."""
        from gpumode.emulated.create import create_host

        name = key or (fixture if isinstance(fixture, str) else fixture.name)
        return Host(self.copy(name, lambda root: create_host(fixture, root), directory))


def copy_host(template: Path, directory: Path) -> Path:
    """Copy an emulated host's tree: symlinks as symlinks, :data:`SHARED` files hard-linked, the rest copied
    (also the shared ones where a hard link is refused: another filesystem, an inode's link limit)."""
    shared = tuple(str(template / top) + os.sep for top in SHARED)

    def link_or_copy(src: str, dst: str) -> None:
        if src.startswith(shared):
            try:
                os.link(src, dst)
                return
            except OSError:
                pass
        shutil.copy2(src, dst)

    shutil.copytree(template, directory, symlinks=True, copy_function=link_or_copy)
    return directory


_active: HostTemplates | None = None


@contextmanager
def session_templates(factory: pytest.TempPathFactory) -> Iterator[HostTemplates]:
    """Make ``factory``'s templates the ones :func:`emulated_host` uses, for one session
    (``tests/conftest.py``)."""
    global _active
    _active = HostTemplates(factory)
    try:
        yield _active
    finally:
        _active = None


def active() -> HostTemplates:
    if _active is None:
        raise RuntimeError("emulated host templates exist only in a pytest session (see tests/conftest.py)")
    return _active


def emulated_host(fixture: str | HostSpec, directory: Path, key: str | None = None) -> Host:
    """A fresh emulated host for helpers that have no fixture at hand (engine_support, the agent tests)."""
    return active().host(fixture, directory, key)
