"""The NVIDIA tools driver packages ship: ``sriov-manage``, ``nvidia-smi`` (a useful subset), ``nvidia-ctk``.

They exist on the emulated host only while their package is installed (the file is there), and they act
through the same kernel files as the real ones: ``sriov-manage`` performs the real script's unbindLock →
pci-pf-stub → ``sriov_numvfs`` → nvidia dance with :meth:`Host.write`, so every errno along the way is the
kernel's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gpumode.domain import GPU_CLASSES, NVIDIA_VENDOR, PciAddress, PciAddressError
from gpumode.emulated import nvidia
from gpumode.emulated.interrupts import signal_point
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.packages import CATALOGUE, Outcome, installed
from gpumode.emulated.spec import VgpuTypeSpec
from gpumode.emulated.state import Device, KernelState
from gpumode.host.root import Host

PF_STUB = "pci-pf-stub"
PCI = "sys/bus/pci"


def _read(path: Path) -> str:
    return path.read_text().strip()


# --- sriov-manage -----------------------------------------------------------------------------------------


def sriov_manage(root: Path, args: list[str]) -> Outcome:
    """``sriov-manage <-e|-d> <ssss:bb:dd.f|ALL>``."""
    usage = "Usage: sriov-manage <-e|-d> <ssss:bb:dd.f|ALL>\n"
    if args in (["-h"], ["--help"]):
        return 0, usage, ""
    if len(args) != 2 or args[0] not in ("-e", "-d"):
        return 1, "", usage
    enable = args[0] == "-e"
    if args[1] == "ALL":
        targets = _all_gpus(root)
    else:
        try:
            targets = [str(PciAddress.parse(args[1]))]
        except PciAddressError:
            return 1, "", f"Invalid BDF {args[1]}\n{usage}"
    out = ""
    for bdf in targets:
        rc, o, e = _manage_one(root, bdf, enable)
        out += o
        if rc:
            return rc, out, e
    return 0, out, ""


def _all_gpus(root: Path) -> list[str]:
    """``lspci -Dd 10de: -s 0.0`` limited to VGA/3D controllers, as the script selects them."""
    out = []
    for dev in sorted((root / PCI / "devices").iterdir()):
        addr = PciAddress.parse(dev.name)
        if addr.device or addr.function or (dev / "physfn").exists():
            continue
        if int(_read(dev / "vendor"), 16) == NVIDIA_VENDOR and int(_read(dev / "class"), 16) >> 16 == 0x03:
            out.append(dev.name)
    return out


def _driver(dev: Path) -> str | None:
    link = dev / "driver"
    return link.resolve().name if link.exists() else None


def _manage_one(root: Path, bdf: str, enable: bool) -> Outcome:
    dev = root / PCI / "devices" / bdf
    if not dev.exists():
        return 1, "", f"Device {bdf} not found\n"
    if int(_read(dev / "class"), 16) >> 16 != 0x03:
        return 1, "", "This is not a VGA or 3D controller.\n"
    if not (dev / "sriov_numvfs").exists():
        return 0, "", ""  # not an SR-IOV GPU: nothing to do, silently
    st = EmulatedKernel(root).snapshot()
    model = st.model_of(st.devices[bdf]) if bdf in st.devices else None
    if model is not None and not nvidia.vgpus_on_vfs(st, model):
        return 0, "", ""  # SR-IOV capable, but not a vGPU-on-VF GPU (a T4): the script skips it silently
    from gpumode.emulated.userspace import dispatch  # the script runs modprobe and nvidia-smi

    dispatch(root, ("modprobe", PF_STUB))
    numvfs = int(_read(dev / "sriov_numvfs"))
    if enable and numvfs:
        return 0, f"GPU at {bdf} already has VFs enabled.\n", ""
    if not enable and not numvfs:
        return 0, f"GPU at {bdf} already has VFs disabled.\n", ""
    out = f"{'Enabling' if enable else 'Disabling'} VFs on {bdf}\n"
    host = Host(root)
    try:
        if not enable:
            _unbind_vfs(host, dev)
        _through_pf_stub(host, dev, bdf, str(_read(dev / "sriov_totalvfs")) if enable else "0")
        if enable:
            for vf in sorted(p.resolve() for p in dev.glob("virtfn*")):
                if _driver(vf) is None:
                    host.write(root / PCI / "drivers/nvidia/bind", vf.name)
    except _LockError as exc:
        return 1, out, f"{exc}\n"
    except OSError as exc:
        where = host.relative(Path(exc.filename)) if exc.filename else bdf
        return 1, out, f"sriov-manage: write error on /{where}: {exc.strerror}\n"
    dispatch(root, ("nvidia-smi", "-pm", "1"))
    return 0, out, ""


class _LockError(RuntimeError):
    pass


def _unbind_vfs(host: Host, dev: Path) -> None:
    for link in sorted(dev.glob("virtfn*")):
        vf = link.resolve()
        drv = _driver(vf)
        if drv in ("vfio-pci", "nvidia"):
            host.write(host.path(PCI, "drivers", drv, "unbind"), vf.name)


def _through_pf_stub(host: Host, dev: Path, bdf: str, numvfs: str) -> None:
    """Unbind the PF (under its unbindLock), let pci-pf-stub set sriov_numvfs, give the PF back to nvidia."""
    drv = _driver(dev)
    if drv == "nvidia":
        lock = host.path("proc/driver/nvidia/gpus", bdf, "unbindLock")
        host.write(lock, "1")
        if _read(lock) != "1":
            raise _LockError(f"Cannot obtain unbindLock for {bdf}")
    if drv is not None:
        host.write(host.path(PCI, "drivers", drv, "unbind"), bdf)
    ids = f"{_read(dev / 'vendor')[2:]} {_read(dev / 'device')[2:]}"
    host.write(host.path(PCI, "drivers", PF_STUB, "new_id"), ids)
    if _driver(dev) != PF_STUB:
        host.write(host.path(PCI, "drivers", PF_STUB, "bind"), bdf)
    host.write(dev / "sriov_numvfs", numvfs)
    # halfway: VFs changed, the PF still on pci-pf-stub, its id still in pci-pf-stub's dynamic ids
    signal_point(host.root, "middle")
    host.write(host.path(PCI, "drivers", PF_STUB, "unbind"), bdf)
    host.write(host.path(PCI, "drivers", PF_STUB, "remove_id"), ids)
    host.write(host.path(PCI, "drivers/nvidia/bind"), bdf)


# --- nvidia-smi -------------------------------------------------------------------------------------------

_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
    "NVIDIA driver is installed and running.\n"
)


def _gpus(st: KernelState) -> list[Device]:
    return [
        d
        for d in st.present_devices()
        if d.vendor == NVIDIA_VENDOR and d.class_code in GPU_CLASSES and not d.is_vf and d.driver == "nvidia"
    ]


def _bus_id(address: str) -> str:
    return "0000" + address.upper()


def nvidia_smi(root: Path, args: list[str]) -> Outcome:
    st = EmulatedKernel(root).snapshot()
    core = st.module("nvidia")
    if core is None:
        return 9, _NO_DRIVER, ""
    drivers = [CATALOGUE[n].version for n in installed(root) if n in CATALOGUE and CATALOGUE[n].module_files]
    library = drivers[0].split("-")[0] if drivers else core.version
    if library != core.version:
        return (
            18,
            f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {library}\n",
            "",
        )
    gpus = _gpus(st)
    if args[:1] == ["-L"]:
        return (
            0,
            "".join(
                f"GPU {i}: {nvidia.model_name(g.vendor, g.device)} (UUID: {g.gpu_uuid})\n"
                for i, g in enumerate(gpus)
            ),
            "",
        )
    if args[:1] == ["-pm"] or (args and args[0].startswith("--persistence-mode")):
        value = args[1] if args[:1] == ["-pm"] and len(args) > 1 else args[0].partition("=")[2]
        if value not in ("0", "1", "ENABLED", "DISABLED"):
            return 2, "", f'Invalid persistence mode "{value}".\n'
        word = "Enabled" if value in ("1", "ENABLED") else "Disabled"
        lines = "".join(f"{word} persistence mode for GPU {_bus_id(g.address)}.\n" for g in gpus)
        return 0, lines + "All done.\n", ""
    if args[:1] == ["-q"]:
        return 0, _query(st, core.version, gpus), ""
    if args[:1] == ["vgpu"]:
        return _vgpu(st, gpus, args[1:])
    if not args:
        return 0, _summary(st, core.version, gpus), ""
    return (
        2,
        "",
        f"Invalid combination of input arguments: {' '.join(args)}. Please run 'nvidia-smi -h' for help.\n",
    )


def _summary(st: KernelState, version: str, gpus: list[Device]) -> str:
    lines = [
        "+-----------------------------------------------------------------------------------------+",
        f"| NVIDIA-SMI {version:<20} Driver Version: {version:<16} CUDA Version: 12.4     |",
        "|-----------------------------------------+------------------------+----------------------+",
    ]
    for i, g in enumerate(gpus):
        name = nvidia.model_name(g.vendor, g.device).removeprefix("NVIDIA ")
        lines.append(f"| {i:>3}  {name:<34} | {_bus_id(g.address):<22} |                      |")
    lines.append(
        "+-----------------------------------------+------------------------+----------------------+"
    )
    return "\n".join(lines) + "\n"


def _query(st: KernelState, version: str, gpus: list[Device]) -> str:
    host_vgpu = nvidia.vgpu_manager_active(st)
    out = (
        "\n==============NVSMI LOG==============\n\n"
        f"Driver Version                            : {version}\n"
        "CUDA Version                              : 12.4\n\n"
        f"Attached GPUs                             : {len(gpus)}\n"
    )
    for g in gpus:
        model = st.model_of(g)
        sriov = bool(model and nvidia.vgpus_on_vfs(st, model))
        out += (
            f"GPU {_bus_id(g.address)}\n"
            f"    Product Name                          : {nvidia.model_name(g.vendor, g.device)}\n"
            f"    GPU UUID                              : {g.gpu_uuid}\n"
            "    GPU Virtualization Mode\n"
            f"        Virtualization Mode               : {'Host VGPU' if host_vgpu else 'None'}\n"
            f"        Host VGPU Mode                    : "
            f"{('SR-IOV' if sriov else 'Non SR-IOV') if host_vgpu else 'N/A'}\n"
        )
    return out


def _vgpu(st: KernelState, gpus: list[Device], args: list[str]) -> Outcome:
    if not nvidia.vgpu_manager_active(st):
        return 6, "No supported devices in vGPU mode\n", ""
    if args[:1] in (["-c"], ["--creatable"]):
        out = ""
        for g in gpus:
            out += f"GPU {_bus_id(g.address)}\n"
            out += "".join(f"    {t.type_id:<5d} : {t.name}\n" for t in _creatable(st, g))
        return 0, out, ""
    if args and args[0] not in ("-q", "--query"):
        return 2, "", f"Invalid combination of input arguments: vgpu {' '.join(args)}\n"
    out = ""
    for g in gpus:
        active = [
            m for m in st.mdevs.values() if nvidia.physical_gpu(st, st.devices[m.parent]).address == g.address
        ]
        vfs = [vf for vf in st.vfs_of(g.address) if vf.vgpu_type]
        out += f"GPU {_bus_id(g.address)}\n    Active vGPUs                      : {len(active) + len(vfs)}\n"
        for m in active:
            out += f"    vGPU {m.uuid}: nvidia-{m.type_id} on {m.parent}\n"
        for vf in vfs:
            out += f"    vGPU on VF {vf.address}: type {vf.vgpu_type}\n"
    return 0, out, ""


def _creatable(st: KernelState, gpu: Device) -> list[VgpuTypeSpec]:
    model = st.model_of(gpu)
    if model is None:
        return []
    if nvidia.vgpu_interface(st, model) == "vendor":
        free = next(
            (vf for vf in st.vfs_of(gpu.address) if vf.vgpu_type == 0 and vf.driver == "nvidia"), None
        )
        return nvidia.creatable_types(st, free) if free is not None else []
    parents = [vf for vf in st.vfs_of(gpu.address) if nvidia.is_mdev_parent(st, vf)] or (
        [gpu] if nvidia.is_mdev_parent(st, gpu) else []
    )
    return [t for t in model.vgpu_types if any(nvidia.available_instances(st, p, t) for p in parents)]


# --- nvidia-ctk -------------------------------------------------------------------------------------------

_RUNTIME_CONFIG = {"containerd": "etc/containerd/config.toml", "docker": "etc/docker/daemon.json"}


def nvidia_ctk(root: Path, args: list[str]) -> Outcome:
    """``nvidia-ctk runtime configure --runtime=containerd|docker [--set-as-default]``."""
    if args[:2] != ["runtime", "configure"]:
        return 1, "", f"Incorrect Usage: unsupported command {' '.join(args[:2])}\n"
    runtime = "docker"
    for arg in args[2:]:
        if arg.startswith("--runtime="):
            runtime = arg.split("=", 1)[1]
    if runtime not in _RUNTIME_CONFIG:
        return 1, "", f"level=error msg=\"unrecognized runtime '{runtime}'\"\n"
    path = root / _RUNTIME_CONFIG[runtime]
    path.parent.mkdir(parents=True, exist_ok=True)
    default = "--set-as-default" in args
    if runtime == "docker":
        config: dict[str, object] = {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
        if default:
            config["default-runtime"] = "nvidia"
        path.write_text(json.dumps(config, indent=4) + "\n")
    else:
        path.write_text(
            'version = 2\n\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
            '  runtime_type = "io.containerd.runc.v2"\n'
            '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
            '    BinaryName = "/usr/bin/nvidia-container-runtime"\n'
            + (
                '\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "nvidia"\n'
                if default
                else ""
            )
        )
    return (
        0,
        "",
        (
            f'level=info msg="Wrote updated config to /{_RUNTIME_CONFIG[runtime]}"\n'
            f'level=info msg="It is recommended that {runtime} daemon be restarted."\n'
        ),
    )


TOOLS: dict[str, tuple[str, Callable[[Path, list[str]], Outcome]]] = {
    "sriov-manage": ("usr/lib/nvidia/sriov-manage", sriov_manage),
    "nvidia-smi": ("usr/bin/nvidia-smi", nvidia_smi),
    "nvidia-ctk": ("usr/bin/nvidia-ctk", nvidia_ctk),
}
