"""Small builders of host snapshots and VMs for the planner and policy tests (no sysfs, no emulated host)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumode.domain import (
    CLASS_3D,
    DriverState,
    Flavour,
    Gpu,
    HostSnapshot,
    LoadedModule,
    Mdev,
    MdevType,
    Mode,
    NvidiaDriver,
    Package,
    PciAddress,
    PciFunction,
    Sriov,
    SwitchRequest,
    VendorVgpu,
    Vm,
    VmDevice,
    VmPolicy,
)
from gpumode.modes.catalog import Catalog, load_catalog
from gpumode.modes.plan import plan_switch
from gpumode.modes.policy import Whitelist, load_whitelist

T4, A16, L40S, H100, B200 = 0x1EB8, 0x25B6, 0x26B9, 0x2330, 0x2901
NAMES = {T4: "Tesla T4", A16: "A16", L40S: "L40S", H100: "H100 SXM5", B200: "B200"}
# the board's subsystem id (the catalog tells the A16 from the A2, which shares its device id, by it)
SUBSYSTEMS = {A16: 0x14A9, T4: 0x12A2, L40S: 0x1851}
CLASS_HDA = 0x040300
CLASS_BRIDGE = 0x060400

CATALOG = load_catalog()
WHITELIST = load_whitelist()


VF_OFFSET = 4  # NVIDIA's SR-IOV GPUs: VF n is PF + 4 + n (stride 1)


def vf_address(pf: str, index: int) -> str:
    a = PciAddress.parse(pf)
    return str(PciAddress.from_routing_id(a.domain, a.routing_id + VF_OFFSET + index))


@dataclass
class HostBuilder:
    hostname: str = "node-1"
    functions: list[PciFunction] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    modules: list[LoadedModule] = field(default_factory=list)
    packages: list[Package] = field(default_factory=list)
    services: dict[str, bool] = field(default_factory=dict)
    flavour: Flavour | None = None
    nvswitches: list[str] = field(default_factory=list)
    _group: int = 10

    def gpu(
        self,
        address: str,
        device: int = L40S,
        *,
        mode: Mode = Mode.NONE,
        companions: tuple[tuple[str, int, str | None], ...] = (),
        total_vfs: int = 0,
        num_vfs: int = 0,
        vendor_types: dict[int, int] | None = None,  # VF index -> current_vgpu_type
        pf_mdevs: tuple[tuple[str, int], ...] = (),  # (uuid, type id) on the PF
        vf_mdevs: dict[int, tuple[str, int]] | None = None,  # VF index -> (uuid, type id)
        pf_mdev_types: tuple[tuple[int, str, int], ...] = (),  # (type id, name, available)
        iommu: bool = True,
    ) -> HostBuilder:
        """Add a GPU in ``mode``; the driver follows from the mode, as discovery would see it."""
        driver = {Mode.ACCEL: "nvidia", Mode.VGPU: "nvidia", Mode.PASSTHROUGH: "vfio-pci", Mode.NONE: None}[
            mode
        ]
        group = self._group if iommu else None
        self._group += 1
        pf = PciFunction(
            address,
            0x10DE,
            device,
            0x10DE,
            SUBSYSTEMS.get(device, 0x1234),
            CLASS_3D,
            0xA1,
            numa_node=0,
            iommu_group=group,
            driver=driver,
            driver_override="vfio-pci" if mode is Mode.PASSTHROUGH else None,
        )
        if total_vfs:
            vfs_now = [vf_address(address, i) for i in range(num_vfs)]
            pf.sriov = Sriov(total_vfs, num_vfs, vfs_now, offset=VF_OFFSET, stride=1)
        pf.mdevs = [Mdev(u, f"nvidia-{t}", address) for u, t in pf_mdevs]
        pf.mdev_types = [MdevType(f"nvidia-{i}", n, "", avail, "vfio-pci") for i, n, avail in pf_mdev_types]
        self.functions.append(pf)
        vfs: list[str] = []
        vgpus: list[str] = []
        mdevs = [u for u, _ in pf_mdevs]
        for i in range(num_vfs):
            vf = PciFunction(
                vf_address(address, i),
                0x10DE,
                device,
                0x10DE,
                0x0000,  # NVIDIA VFs report subsystem 10de:0000
                CLASS_3D,
                0xA1,
                iommu_group=100 + i,
                driver="nvidia",
                physfn=address,
            )
            if vendor_types is not None:
                current = vendor_types.get(i, 0)
                vf.vendor_vgpu = VendorVgpu({1147: "NVIDIA L40S-1Q", 1150: "NVIDIA L40S-4Q"}, current)
                if current:
                    vgpus.append(vf.address)
            if vf_mdevs and i in vf_mdevs:
                uuid, type_id = vf_mdevs[i]
                vf.mdevs = [Mdev(uuid, f"nvidia-{type_id}", vf.address)]
                mdevs.append(uuid)
            self.functions.append(vf)
            vfs.append(vf.address)
        for comp, cls, comp_driver in companions:
            self.functions.append(
                PciFunction(
                    comp,
                    0x10DE,
                    0x22BA,
                    0x10DE,
                    0x1234,
                    cls,
                    0xA1,
                    iommu_group=group,
                    driver=comp_driver,
                    driver_override="vfio-pci" if comp_driver == "vfio-pci" else None,
                )
            )
        self.gpus.append(
            Gpu(
                address,
                device,
                NAMES.get(device, "GPU"),
                0,
                group,
                driver,
                mode,
                companions=[c for c, _, _ in companions],
                vfs=vfs,
                mdevs=sorted(mdevs),
                vgpus=vgpus,
            )
        )
        return self

    def module(self, name: str, users: tuple[str, ...] = (), *, state: str = "Live") -> HostBuilder:
        self.modules.append(LoadedModule(name, 1000, len(users), list(users), state))
        return self

    def datacenter(self, *, nvswitch: bool = False, drm: bool = False, loaded: bool = True) -> HostBuilder:
        """The data-center driver installed (and loaded, services running), as the HGX fixture has it."""
        self.flavour = Flavour.DATACENTER if loaded else None
        names = ["nvidia-driver-550-server", "nvidia-container-toolkit"]
        if nvswitch:
            names.insert(1, "nvidia-fabricmanager-550")
            self.nvswitches = ["0000:05:00.0"]
        self.packages = [Package(n, "550.127.05", Flavour.DATACENTER) for n in names]
        if loaded:
            self.module("nvidia", ("nvidia_uvm", "nvidia_modeset"))
            self.module("nvidia_uvm")
            self.module("nvidia_modeset", ("nvidia_drm",) if drm else ())
            if drm:
                self.module("nvidia_drm")
            self.services["nvidia-persistenced.service"] = True
            if nvswitch:
                self.services["nvidia-fabricmanager.service"] = True
        return self

    def vgpu_manager(self) -> HostBuilder:
        self.flavour = Flavour.VGPU
        self.packages = [Package("nvidia-vgpu-ubuntu-550", "550.127.06", Flavour.VGPU)]
        self.module("nvidia", ("nvidia_vgpu_vfio",))
        self.module("nvidia_vgpu_vfio")
        self.services.update({"nvidia-vgpud.service": True, "nvidia-vgpu-mgr.service": True})
        return self

    def build(self) -> HostSnapshot:
        nvidia = NvidiaDriver(
            loaded=self.flavour is not None,
            flavour=self.flavour,
            version="550.127.05" if self.flavour else None,
            vgpu_vfio_loaded=self.flavour is Flavour.VGPU,
            packages=list(self.packages),
            services=dict(self.services),
        )
        snap = HostSnapshot(
            self.hostname,
            "6.8.0-45-generic",
            list(self.functions),
            list(self.gpus),
            list(self.nvswitches),
            list(self.modules),
            nvidia,
            DriverState.MIXED,
        )
        snap.fingerprint = snap.compute_fingerprint()
        return snap


def vm(name: str, *devices: str, running: bool = True) -> Vm:
    """A VM; devices as ``pci:ADDR`` / ``mdev:UUID``."""
    devs = []
    for d in devices:
        kind, _, ident = d.partition(":")
        assert kind in ("pci", "mdev")
        devs.append(VmDevice("pci" if kind == "pci" else "mdev", ident))
    return Vm(name, f"uuid-{name}", running, devs)


def request(mode: Mode, *gpus: str, policy: VmPolicy = VmPolicy.GPU, **options: object) -> SwitchRequest:
    return SwitchRequest(mode, list(gpus), vm_policy=policy, **options)  # type: ignore[arg-type]


def plan(
    snap: HostSnapshot,
    req: SwitchRequest,
    vms: list[Vm] | None = None,
    *,
    catalog: Catalog = CATALOG,
    whitelist: Whitelist = WHITELIST,
    host_group: str | None = None,
):  # type: ignore[no-untyped-def]
    return plan_switch(snap, vms or [], req, catalog=catalog, whitelist=whitelist, host_group=host_group)


def actions(p) -> list[str]:  # type: ignore[no-untyped-def]
    return [s.action for s in p.steps if s.where == "host"]


def steps_of(p, action: str):  # type: ignore[no-untyped-def]
    return [s for s in p.steps if s.action == action]
