"""Discovery against this machine's real /sys, checked function by function against lspci.

lspci reads the same kernel through its own code (and its own copy of pci.ids), so agreement on addresses,
ids, class, revision and bound driver is an independent check that discovery reads a real kernel right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_discover_tree import lspci, needs_lspci, parse_lspci

from gpumode.host.discover import discover

pytestmark = [
    needs_lspci,
    pytest.mark.skipif(
        not Path("/sys/bus/pci/devices").is_dir() or not any(Path("/sys/bus/pci/devices").iterdir()),
        reason="this machine shows no PCI devices in /sys",
    ),
]


def test_discovery_agrees_with_lspci_on_every_function() -> None:
    expected = parse_lspci(lspci("-D", "-nn", "-k"))
    snap = discover("/")
    found = {fn.address: fn for fn in snap.functions}
    assert set(found) == set(expected)
    for address, entry in expected.items():
        fn = found[address]
        assert (fn.vendor, fn.device) == (entry.vendor, entry.device), address
        assert fn.class_code >> 8 == entry.class_id, address
        assert fn.revision == entry.revision, address
        assert fn.driver == entry.driver, address


def test_real_host_basics() -> None:
    snap = discover("/")
    assert snap.hostname == Path("/proc/sys/kernel/hostname").read_text().strip()
    assert snap.kernel == Path("/proc/sys/kernel/osrelease").read_text().strip()
    assert snap.fingerprint == discover("/").fingerprint  # nothing changes between two reads
    for fn in snap.functions:
        assert fn.vendor_name is not None, f"{fn.address}: vendor {fn.vendor:04x} not named by pci.ids"
