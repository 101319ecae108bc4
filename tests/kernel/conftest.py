"""Boot Debian's stock kernel once per session under QEMU and run every guest check in it (``guest.py``).

The kernel, virtme-ng and the sample mdev drivers come from ``scripts/install-kernel-test-deps.sh``
(``.cache/kernel/current`` names them). virtme-ng shares this machine's root file system with the guest
read-only over 9p, so the guest runs this very interpreter and this very ``gpumode``. The guest is shaped like
a GPU host: a multifunction slot (a display function and an HD-audio function, one IOMMU group) behind its
own root port, a single function on another, an SR-IOV-capable NVMe controller on a third, and the kernel's
sample mdev parents (mtty, mdpy). Without udev in the guest ``vng`` exits 255 whatever happens inside, so the
results and the guest's exit status come back through a shared writable directory.

Cost: one boot under TCG (~25–45 s on these machines; KVM when ``/dev/kvm`` really boots a guest) plus the
checks (~1–2 min under TCG) — once per session, shared by every ``kernel`` test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gpumode

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "kernel"
HERE = Path(__file__).resolve().parent
BOOT_TIMEOUT = 600
# no_timer_check: under TCG on a loaded machine the IO-APIC timer test can miss its window and panic
# ("timer doesn't work through Interrupt-remapped IO-APIC"); the check proves nothing in a VM.
KERNEL_ARGS = "intel_iommu=on iommu=pt no_timer_check"

# Root ports get fixed slots so the guest's addresses (guest.py, differential.py) do not depend on how many
# devices virtme-ng adds on bus 0.
QEMU_DEVICES = [
    "-device intel-iommu",
    "-device pcie-root-port,id=rp1,chassis=1,slot=1,bus=pcie.0,addr=0x10",
    "-device bochs-display,bus=rp1,addr=0.0,multifunction=on",
    "-device ich9-intel-hda,bus=rp1,addr=0.1",
    "-device pcie-root-port,id=rp2,chassis=2,slot=2,bus=pcie.0,addr=0x11",
    "-device e1000e,bus=rp2",
    "-device pcie-root-port,id=rp3,chassis=3,slot=3,bus=pcie.0,addr=0x12",
    "-device nvme-subsys,id=subsys0",
    # QEMU 7.2 NVMe SR-IOV: a subsystem, and flexible queue/interrupt resources for the VFs (docs/system/
    # devices/nvme.rst)
    "-device nvme,bus=rp3,serial=gpumode0,subsys=subsys0,"
    "sriov_max_vfs=2,sriov_vq_flexible=4,sriov_vi_flexible=2",
]


def _config() -> dict[str, str]:
    current = CACHE / "current"
    if not current.exists():
        pytest.fail(
            "the kernel test harness is not installed: run scripts/install-kernel-test-deps.sh (as root; "
            "scripts/test.sh does)",
            pytrace=False,
        )
    config = dict(line.split("=", 1) for line in current.read_text().splitlines() if "=" in line)
    for key in ("GPUMODE_KERNEL_IMAGE", "GPUMODE_KERNEL_VNG"):
        if not Path(config.get(key, "")).exists():
            pytest.fail(f"{current}: {key} names a missing file; rerun the install script", pytrace=False)
    return config


def _kvm_boots(image: str) -> bool:
    """True when /dev/kvm boots this kernel to its first message. On some machines /dev/kvm is a paravirtual
    KVM that boots no stock kernel (QEMU hangs after SeaBIOS), so it is tried once, briefly, and the answer
    kept per host kernel and QEMU build."""
    forced = os.environ.get("GPUMODE_KERNEL_ACCEL", "")
    if forced in ("kvm", "tcg"):
        return forced == "kvm"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256((Path("/proc/version").read_text() + qemu + image).encode()).hexdigest()[:16]
    answer = CACHE / f"kvm-{key}"
    if answer.exists():
        return answer.read_text().strip() == "yes"
    log = CACHE / "kvm-probe.log"
    log.unlink(missing_ok=True)
    argv = ["qemu-system-x86_64", "-accel", "kvm", "-cpu", "host", "-m", "256", "-display", "none"]
    argv += ["-no-reboot", "-kernel", image, "-append", "console=ttyS0 panic=-1", "-serial", f"file:{log}"]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        deadline = time.monotonic() + 20
        booted = False
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and "Linux version" in log.read_text(errors="replace"):
                booted = True
                break
            time.sleep(0.5)
        proc.kill()
    answer.write_text("yes\n" if booted else "no\n")
    return booted


@pytest.fixture(scope="session")
def guest() -> dict[str, Any]:
    """The results of one boot: ``{check name: {ok, error, data, seconds}}`` plus ``_boot`` timings."""
    config = _config()
    # Not under the session's tmp dir: that may be /dev/shm, which the guest's own /dev would hide. The last
    # run stays here for a look (console.log, guest.log, results.json).
    out = CACHE / "last-run"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    src = Path(gpumode.__file__).resolve().parents[1]
    log, status = shlex.quote(str(out / "guest.log")), shlex.quote(str(out / "exit"))
    script = (
        f"cd {shlex.quote(str(HERE))} && PYTHONPATH={shlex.quote(f'{src}:{HERE}')} "
        f"{shlex.quote(sys.executable)} guest.py {shlex.quote(str(out))} > {log} 2>&1; echo $? > {status}"
    )
    kvm = _kvm_boots(config["GPUMODE_KERNEL_IMAGE"])
    vng = config["GPUMODE_KERNEL_VNG"]
    argv = [vng, "--run", config["GPUMODE_KERNEL_IMAGE"], "--disable-microvm", "--force-9p"]
    argv += [] if kvm else ["--disable-kvm"]
    argv += ["--cpus", "2", "--memory", "1G", "--rwdir", str(out), "--append", KERNEL_ARGS]
    argv += [f"--qemu-opts={' '.join(QEMU_DEVICES)}", "--exec", script, "--verbose"]
    env = dict(os.environ, PATH=f"{Path(vng).parent}:{os.environ.get('PATH', '')}")
    start = time.monotonic()
    for attempt in (1, 2):
        for stale in ("console.log", "guest.log", "exit", "results.json"):
            (out / stale).unlink(missing_ok=True)
        with (out / "console.log").open("w") as console:
            # its own session, so a timeout ends virtme-run and QEMU too, not only vng
            proc = subprocess.Popen(
                argv, stdout=console, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                proc.wait(timeout=BOOT_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"the guest did not finish within {BOOT_TIMEOUT} s; see {out / 'console.log'}")
        console_text = (out / "console.log").read_text(errors="replace")
        # An emulated CPU starved by a busy machine can fail the kernel's early timer check; boot once more.
        if attempt == 1 and not (out / "results.json").exists() and "Kernel panic" in console_text:
            continue
        break
    seconds = time.monotonic() - start
    exit_file = out / "exit"
    if not exit_file.exists() or not (out / "results.json").exists():
        panic = console_text.find("Kernel panic")
        tail = console_text[panic : panic + 3000] if panic >= 0 else console_text[-3000:]
        guest_log = out / "guest.log"
        guest_tail = guest_log.read_text(errors="replace")[-3000:] if guest_log.exists() else ""
        pytest.fail(f"the guest wrote no results (console):\n{tail}\n{guest_tail}", pytrace=False)
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    results["_boot"] = {
        "accel": "kvm" if kvm else "tcg",
        "seconds": round(seconds, 1),
        "exit": exit_file.read_text().strip(),
        "log": (out / "guest.log").read_text(errors="replace")[-3000:],
    }
    return results
