"""One start of REAL nova-compute (nova's libvirt driver, its resource tracker, PCI tracker and Placement
report client) over nova's own fakelibvirt, run by the nova test venv's python
(``scripts/install-openstack-test-deps.sh``) as a subprocess of gpumode's tests: nova's eventlet and global
config never enter gpumode's test process.

    python compute.py SCENARIO.json RESULT.json

The scenario (written by ``tests/openstack/realnova.py``): ``hostname``, ``placement_url``, the config files
and directories nova-compute reads (``config_files``, ``config_dirs``: the emulated host's ``/etc/nova``), and
``snapshot``: gpumode's snapshot of the emulated host. Each PCI function of the snapshot becomes a libvirt
node device with what libvirt would show for it (vendor/product, the bound driver, NUMA node, IOMMU group,
SR-IOV ``virt_functions``/``phys_function``, the ``mdev_types`` the driver offers with their available
instances), and each existing mdev a libvirt mdev node device: nova reads nothing else of the host.

nova's functional-test harness (``nova.test.TestCase``) supplies what a compute node needs besides the driver:
its database (in memory, so each start is a fresh conductor DB, as after a reinstall; the compute node keeps
its uuid, as nova's ``compute_id`` file does), RPC over the fake transport and a conductor. Placement is the
REAL one the tests started: the report client speaks HTTP to it with the admin token ``noauth2`` accepts. The
driver starts, ``update_available_resource`` runs once (as at every nova-compute start) and the process exits.

The result: ``ok``, nova's WARNING and ERROR log lines, and ``error`` (a traceback) when nova-compute failed
to start — as the real service would fail and log on that configuration.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
import unittest
import uuid
from typing import Any

NODE_NAMESPACE = uuid.UUID("3d5c0a5e-4a40-4d3f-8a6b-6e6f76612d6e")  # the compute node's uuid, per hostname


def nodedev_name(address: str) -> str:
    """libvirt's node device name for a PCI address: ``pci_0000_18_00_0``."""
    return "pci_" + address.replace(":", "_").replace(".", "_")


def _addr_xml(address: str) -> str:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return f"<address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>"


class MirroredPci:
    """A PCI node device as libvirt describes it (``virsh nodedev-dumpxml``), from one snapshot function."""

    def __init__(self, fn: dict[str, Any], functions: dict[str, dict[str, Any]]) -> None:
        self.fn = fn
        self.address = fn["address"]
        self.mac_address = None
        self.is_capable_of_mdevs = bool(fn.get("mdev_types"))
        domain, bus, rest = self.address.split(":")
        slot, function = rest.split(".")
        caps = []
        sriov = fn.get("sriov")
        if sriov and sriov.get("vfs"):
            vfs = "".join(_addr_xml(vf) for vf in sriov["vfs"] if vf in functions)
            total = sriov["total_vfs"]
            caps.append(f"<capability type='virt_functions' maxCount='{total}'>{vfs}</capability>")
        if fn.get("physfn"):
            caps.append(f"<capability type='phys_function'>{_addr_xml(fn['physfn'])}</capability>")
        if fn.get("mdev_types"):
            types = "".join(
                f"<type id='{t['type_id']}'><name>{t['name']}</name><deviceAPI>{t['device_api']}</deviceAPI>"
                f"<availableInstances>{t['available_instances']}</availableInstances></type>"
                for t in fn["mdev_types"]
            )
            caps.append(f"<capability type='mdev_types'>{types}</capability>")
        numa = fn.get("numa_node")
        iommu = fn.get("iommu_group")
        parent = nodedev_name(fn["physfn"]) if fn.get("physfn") else "computer"
        self.xml = (
            f"<device><name>{nodedev_name(self.address)}</name>"
            f"<path>/sys/devices/pci{domain}:{bus}/{self.address}</path><parent>{parent}</parent>"
            + (f"<driver><name>{fn['driver']}</name></driver>" if fn.get("driver") else "")
            + f"<capability type='pci'><class>0x{fn['class_code']:06x}</class>"
            f"<domain>{int(domain, 16)}</domain>"
            f"<bus>{int(bus, 16)}</bus><slot>{int(slot, 16)}</slot><function>{int(function, 16)}</function>"
            f"<product id='0x{fn['device']:04x}'>{fn.get('device_name') or ''}</product>"
            f"<vendor id='0x{fn['vendor']:04x}'>{fn.get('vendor_name') or ''}</vendor>"
            + "".join(caps)
            + (
                f"<iommuGroup number='{iommu}'>{_addr_xml(self.address)}</iommuGroup>"
                if iommu is not None
                else ""
            )
            + (f"<numa node='{numa}'/>" if numa is not None and numa >= 0 else "")
            + "</capability></device>"
        )

    def XMLDesc(self, flags: int) -> str:
        return self.xml


class MirroredMdev:
    def __init__(self, mdev: dict[str, Any]) -> None:
        self.xml = (
            f"<device><name>mdev_{mdev['uuid'].replace('-', '_')}</name>"
            f"<path>/sys/devices/{mdev['parent']}/{mdev['uuid']}</path>"
            f"<parent>{nodedev_name(mdev['parent'])}</parent><driver><name>vfio_mdev</name></driver>"
            f"<capability type='mdev'><type id='{mdev['type_id']}'/><uuid>{mdev['uuid']}</uuid>"
            "<iommuGroup number='0'/></capability></device>"
        )

    def XMLDesc(self, flags: int) -> str:
        return self.xml


class RootedSysfs:
    """``os``/``glob``/``open`` for ``nova.pci.utils``, which reads sysfs itself (is a device a PF, its VFs'
    and net devices' links): its ``/sys`` paths are read under the emulated host's root, the rest as they
    are."""

    def __init__(self, root: str) -> None:
        import glob
        import os

        self.root, self._os, self._glob = root.rstrip("/"), os, glob
        outer = self

        class Path:
            def __getattr__(self, name: str) -> Any:
                real = getattr(os.path, name)
                if name in ("isdir", "exists", "isfile", "islink", "realpath", "readlink", "lexists"):
                    return lambda p, *a, **k: outer._unroot(real(outer.rooted(p), *a, **k))
                return real

        self.path = Path()

    def rooted(self, path: Any) -> Any:
        return self.root + path if isinstance(path, str) and path.startswith("/sys/") else path

    def _unroot(self, value: Any) -> Any:
        if isinstance(value, str) and value.startswith(self.root + "/"):
            return value[len(self.root) :]
        return value

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._os, name)
        if name in ("listdir", "readlink", "stat", "scandir"):
            return lambda p, *a, **k: real(self.rooted(p), *a, **k)
        return real

    def glob_module(self) -> Any:
        outer = self

        class Glob:
            def glob(self, pattern: str, *a: Any, **k: Any) -> list[str]:
                return [outer._unroot(p) for p in outer._glob.glob(outer.rooted(pattern), *a, **k)]

            def iglob(self, pattern: str, *a: Any, **k: Any) -> Any:
                return iter(self.glob(pattern, *a, **k))

        return Glob()

    def open(self, path: Any, *a: Any, **k: Any) -> Any:
        return open(self.rooted(path), *a, **k)


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    from unittest import mock

    import fixtures
    from keystoneauth1 import adapter as ka
    from keystoneauth1 import session as ks
    from keystoneauth1 import token_endpoint
    from nova import conf, test
    from nova.tests import fixtures as nova_fixtures
    from nova.tests.fixtures import libvirt as fakelibvirt

    CONF = conf.CONF
    snapshot = scenario["snapshot"]
    hostname = scenario["hostname"]
    functions = {fn["address"]: fn for fn in snapshot["functions"]}
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    def placement_client(self: Any) -> Any:
        # nova's own test fixtures stub openstacksdk's endpoint lookup (OpenStackSDKFixture), so the report
        # client gets the adapter nova's config would build: admin token, the test Placement's endpoint.
        self.clear_provider_cache(init=True)
        auth = token_endpoint.Token(scenario["placement_url"], "admin")
        client = ka.Adapter(ks.Session(auth=auth), service_type="placement", raise_exc=False)
        client.additional_headers = {"accept": "application/json", **scenario.get("headers", {})}
        return client

    outcome: dict[str, Any] = {}

    class Start(test.TestCase):
        def test_start(self) -> None:
            logging.getLogger().addHandler(Collect())
            # nova-compute reads /etc/nova/nova.conf and /etc/nova/nova.conf.d/*.conf (oslo.config's defaults)
            args = [f"--config-file={f}" for f in scenario["config_files"]]
            args += [f"--config-dir={d}" for d in scenario["config_dirs"]]
            CONF(args, project="nova", default_config_files=[], default_config_dirs=[])
            self.flags(compute_driver="libvirt.LibvirtDriver")
            self.flags(instances_path=self.useFixture(fixtures.TempDir()).path)
            self.useFixture(nova_fixtures.CastAsCallFixture(self))
            self.useFixture(nova_fixtures.NeutronFixture(self))
            self.useFixture(nova_fixtures.GlanceFixture(self))
            self.useFixture(nova_fixtures.LibvirtImageBackendFixture())
            self.useFixture(nova_fixtures.CGroupsFixture())
            self.useFixture(nova_fixtures.LibvirtFixture())
            self.useFixture(nova_fixtures.OSBrickFixture())
            sysfs = RootedSysfs(scenario["root"])
            self.useFixture(fixtures.MonkeyPatch("nova.pci.utils.os", sysfs))
            self.useFixture(fixtures.MonkeyPatch("nova.pci.utils.glob", sysfs.glob_module()))
            self.useFixture(fixtures.MonkeyPatch("nova.pci.utils.open", sysfs.open))
            self.useFixture(
                fixtures.MockPatch(
                    "nova.scheduler.client.report.SchedulerReportClient._create_client", placement_client
                )
            )
            self.useFixture(
                fixtures.MockPatch(
                    "nova.virt.libvirt.LibvirtDriver._get_local_gb_info",
                    return_value={"total": 1024, "used": 0, "free": 1024},
                )
            )
            self.useFixture(
                fixtures.MockPatch("nova.virt.libvirt.host.Host.get_online_cpus", return_value=set(range(8)))
            )
            pci = fakelibvirt.HostPCIDevicesInfo(num_pci=0, num_pfs=0, num_vfs=0)
            pci.devices = {nodedev_name(a): MirroredPci(fn, functions) for a, fn in functions.items()}
            mdevs = fakelibvirt.HostMdevDevicesInfo(
                {
                    f"mdev_{m['uuid'].replace('-', '_')}": MirroredMdev(m)
                    for fn in snapshot["functions"]
                    for m in fn.get("mdevs", [])
                }
            )
            connection = fakelibvirt.Connection(
                "qemu:///system",
                version=fakelibvirt.FAKE_LIBVIRT_VERSION,
                hv_version=fakelibvirt.FAKE_QEMU_VERSION,
                host_info=fakelibvirt.HostInfo(cpu_nodes=2, cpu_sockets=1, cpu_cores=2, cpu_threads=2),
                pci_info=pci,
                mdev_info=mdevs,
                hostname=hostname,
            )
            node = str(uuid.uuid5(NODE_NAMESPACE, hostname))
            with (
                mock.patch("nova.virt.libvirt.host.Host.get_connection", return_value=connection),
                mock.patch("nova.virt.node.get_local_node_uuid", return_value=node),
            ):
                self.start_service("conductor")
                compute = self.start_service("compute", host=hostname)
                compute.driver._host.get_node_uuid()
            outcome["node_uuid"] = node

    case = Start("test_start")
    result = unittest.TestResult()
    case.run(result)
    failures = [text for _, text in result.errors + result.failures]
    return {"ok": not failures, "error": "\n".join(failures), "warnings": warnings, **outcome}


def main() -> int:
    scenario_path, result_path = sys.argv[1], sys.argv[2]
    with open(scenario_path) as f:
        scenario = json.load(f)
    try:
        result = run(scenario)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc(), "warnings": []}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
