"""Human names for PCI ids, from the ``pci.ids`` database shipped in ``gpumode/data``.

The file is 1.6 MB and a host only ever has a handful of vendors, so it is never parsed: the raw bytes are
read once per process, the block of the vendor (or class) asked for is located with ``bytes.find``, and the
names inside it are picked out by one regex pass over that block only — in C, no Python loop over the
file's 40,000 lines. Blocks and answers are cached. A lookup of an id that the database does not name
returns ``None``; callers decide how to show an unnamed id.

Format (see the file's header)::

    vendor  vendor_name
    \\tdevice  device_name
    \\t\\tsubvendor subdevice  subsystem_name
    C class  class_name
    \\tsubclass  subclass_name
    \\t\\tprog-if  prog-if_name
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "pci.ids"


# The end of a block: the next line that starts a vendor ("10df  ...") or a class ("C 04  ...").
_TOP_LEVEL = re.compile(rb"\n[0-9a-fA-FC]")
# The end of a device's subsystem lines (or a subclass's prog-ifs): the next singly indented line.
_NEXT_ENTRY = re.compile(rb"\n\t[0-9a-fA-F]")
_DEVICE_LINE = re.compile(rb"\n\t([0-9a-fA-F]{4})  ([^\n]*)")


class PciIds:
    """Lazy, cached lookups in one ``pci.ids`` file."""

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_PATH) -> None:
        self.path = Path(path)
        self._data: bytes | None = None
        self._blocks: dict[bytes, tuple[str, int, int] | None] = {}  # header -> (name, start, end)
        self._names: dict[tuple[int, ...], str | None] = {}
        self._devices: dict[int, dict[int, str]] = {}

    # --- public lookups -----------------------------------------------------------------------------------

    def vendor(self, vendor: int) -> str | None:
        block = self._vendor_block(vendor)
        return block[0] if block else None

    def device(self, vendor: int, device: int) -> str | None:
        devices = self._devices.get(vendor)
        if devices is None:
            # One regex pass over the vendor's block (in C) names all its devices: a host asks for many.
            block = self._vendor_block(vendor)
            devices = {}
            if block:
                for ident, name in _DEVICE_LINE.findall(self._bytes(), block[1], block[2]):
                    devices[int(ident, 16)] = name.decode("utf-8", "replace").strip()
            self._devices[vendor] = devices
        return devices.get(device)

    def subsystem(self, vendor: int, device: int, subvendor: int, subdevice: int) -> str | None:
        """The name of a board (subsystem ids) of ``vendor:device``, as listed under that device."""
        key = (vendor, device, subvendor, subdevice)
        if key not in self._names:
            name = None
            block = self._vendor_block(vendor)
            found = (
                self._entry(b"\n\t%04x  " % device, block[1], block[2]) if block and _u16(device) else None
            )
            if found and _u16(subvendor) and _u16(subdevice):
                sub = self._entry(b"\n\t\t%04x %04x  " % (subvendor, subdevice), found[1], found[2])
                name = sub[0] if sub else None
            self._names[key] = name
        return self._names[key]

    def class_name(self, class_code: int) -> str | None:
        """The most specific name of a 24-bit class code (``0x030200`` → ``3D controller``), as lspci shows
        it: the subclass, falling back to the base class. The programming interface is only shown by lspci in
        verbose mode, so it is not used here (see :meth:`prog_if_name`)."""
        key = (-1, class_code)
        if key not in self._names:
            block = self._class_block(class_code)
            name = None
            if block:
                sub = self._entry(b"\n\t%02x  " % ((class_code >> 8) & 0xFF), block[1], block[2])
                name = sub[0] if sub else block[0]
            self._names[key] = name
        return self._names[key]

    def prog_if_name(self, class_code: int) -> str | None:
        block = self._class_block(class_code)
        if block is None:
            return None
        sub = self._entry(b"\n\t%02x  " % ((class_code >> 8) & 0xFF), block[1], block[2])
        if sub is None:
            return None
        found = self._entry(b"\n\t\t%02x  " % (class_code & 0xFF), sub[1], sub[2])
        return found[0] if found else None

    @property
    def version(self) -> str | None:
        """The ``Version:`` of the database, from its header comment."""
        data = self._bytes()
        start = data.find(b"#\tVersion:", 0, 4096)
        if start < 0:
            return None
        end = data.find(b"\n", start)
        return data[start + len(b"#\tVersion:") : end].decode("ascii", "replace").strip()

    # --- block location -----------------------------------------------------------------------------------

    def _bytes(self) -> bytes:
        if self._data is None:
            try:
                self._data = self.path.read_bytes()
            except OSError:
                # Names are a nicety: a missing database must not stop discovery.
                self._data = b""
        return self._data

    def _vendor_block(self, vendor: int) -> tuple[str, int, int] | None:
        return self._block(b"\n%04x  " % vendor) if _u16(vendor) else None

    def _class_block(self, class_code: int) -> tuple[str, int, int] | None:
        return (
            self._block(b"\nC %02x  " % ((class_code >> 16) & 0xFF)) if 0 <= class_code <= 0xFFFFFF else None
        )

    def _block(self, header: bytes) -> tuple[str, int, int] | None:
        """Name, start and end of the top-level block whose line begins with ``header`` (cached)."""
        if header not in self._blocks:
            data = self._bytes()
            # The class section closes the file: searching it from the end is short.
            start = data.rfind(header) if header.startswith(b"\nC ") else data.find(header)
            found = None
            if start >= 0:
                line_end = data.find(b"\n", start + 1)
                line_end = len(data) if line_end < 0 else line_end
                after = _TOP_LEVEL.search(data, line_end)
                end = after.start() if after else len(data)
                found = (
                    data[start + len(header) : line_end].decode("utf-8", "replace").strip(),
                    line_end,
                    end,
                )
            self._blocks[header] = found
        return self._blocks[header]

    def _entry(self, needle: bytes, start: int, end: int) -> tuple[str, int, int] | None:
        """Name of the line ``needle`` (indented) between ``start`` and ``end``, and the span of the lines
        indented under it."""
        data = self._bytes()
        pos = data.find(needle, start, end)
        if pos < 0:
            return None
        line_end = data.find(b"\n", pos + 1, end)
        line_end = end if line_end < 0 else line_end
        name = data[pos + len(needle) : line_end].decode("utf-8", "replace").strip()
        depth = needle.count(b"\t")
        # The lines under an entry end at the next entry of the same depth (or the end of the block).
        if depth == 1:
            after = _NEXT_ENTRY.search(data, line_end, end)
            sub_end = after.start() if after else end
        else:
            sub_end = line_end
        return name, line_end, sub_end


def _u16(value: int) -> bool:
    return 0 <= value <= 0xFFFF


_default: PciIds | None = None


def default() -> PciIds:
    """The process-wide database of the shipped ``pci.ids`` (one read per process)."""
    global _default
    if _default is None:
        _default = PciIds()
    return _default
