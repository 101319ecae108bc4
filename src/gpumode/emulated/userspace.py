"""The emulated host's userspace: the commands gpumode (or an operator) runs, answered as the real tools do.

:func:`run_emulated` is what :meth:`gpumode.host.root.Host.run` calls on an emulated host. Each command acts
through the emulated kernel (module load/unload, handles) or :meth:`Host.write` exactly as the real tool acts
through syscalls, with the real tool's exit codes and messages. Two things make it a test double:

- every command run is appended to ``DIR/.gpumode-emulated/commands.log`` (JSON lines: argv, returncode,
  stdout, stderr, whether a fault answered it), so tests can assert what a plan actually ran;
- ``DIR/.gpumode-emulated/faults.json`` makes a command fail: it maps an argv prefix (``"apt-get install"``)
  to ``{"returncode": 100, "stderr": "...", "stdout": "", "count": 1}``; a matching command does nothing and
  answers that instead, ``count`` times (see :func:`inject_command_fault`);
- ``DIR/.gpumode-emulated/signals.json`` interrupts a command while it runs: at a named point (``start``:
  before it does anything, ``middle``: halfway through its work, ``end``: done, just before it returns) the
  process running it sends itself a signal (SIGINT, SIGTERM or SIGKILL), as a Ctrl-C, a stop or a crash would
  arrive while the real tool runs (:mod:`gpumode.emulated.interrupts`). Each tool says where its middle is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpumode.emulated import apt, nvidia_tools, services
from gpumode.emulated import modules as kmodules
from gpumode.emulated.interrupts import current_command, signal_point
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.packages import Outcome
from gpumode.host.root import EMULATION_MARKER, CommandResult, Host

COMMAND_LOG = "commands.log"
FAULTS_FILE = "faults.json"
LOCK_FILE = "userspace.lock"

Handler = Callable[[Path, list[str]], Outcome]


# --- fault injection and the command log ------------------------------------------------------------------


def inject_command_fault(
    root: Path, prefix: str, *, returncode: int = 1, stderr: str = "", stdout: str = "", count: int = 1
) -> None:
    """Make the next ``count`` commands whose argv starts with ``prefix`` (shell-split words) fail so."""
    words = shlex.split(prefix)
    if not words:
        raise ValueError("a fault needs a command prefix, e.g. 'apt-get install'")
    if count < 1:
        raise ValueError(f"fault count must be >= 1, got {count}")
    if returncode == 0:
        raise ValueError("a fault must fail: returncode 0 is success")
    faults = _read_faults(root)
    faults[" ".join(words)] = {"returncode": returncode, "stderr": stderr, "stdout": stdout, "count": count}
    _write_faults(root, faults)


def read_command_log(root: Path) -> list[dict[str, object]]:
    """Every logged command, oldest first."""
    path = root / EMULATION_MARKER / COMMAND_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_faults(root: Path) -> dict[str, dict[str, object]]:
    path = root / EMULATION_MARKER / FAULTS_FILE
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping command prefixes to faults")
    return data


def _write_faults(root: Path, faults: dict[str, dict[str, object]]) -> None:
    path = root / EMULATION_MARKER / FAULTS_FILE
    if not faults:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults, indent=1, sort_keys=True))
    tmp.replace(path)


def _take_fault(root: Path, argv: tuple[str, ...]) -> Outcome | None:
    """The fault whose prefix is the longest match of ``argv``, consumed once; None when none matches."""
    faults = _read_faults(root)
    best = None
    for prefix in faults:
        words = prefix.split()
        if list(argv[: len(words)]) == words and (best is None or len(words) > len(best.split())):
            best = prefix
    if best is None:
        return None
    fault = faults[best]
    count = int(str(fault.get("count", 1))) - 1
    if count <= 0:
        del faults[best]
    else:
        fault["count"] = count
    _write_faults(root, faults)
    return int(str(fault.get("returncode", 1))), str(fault.get("stdout", "")), str(fault.get("stderr", ""))


def _log(root: Path, argv: tuple[str, ...], outcome: Outcome, faulted: bool) -> None:
    entry = {
        "time": round(time.time(), 3),
        "argv": list(argv),
        "returncode": outcome[0],
        "stdout": outcome[1],
        "stderr": outcome[2],
        "fault": faulted,
    }
    with open(root / EMULATION_MARKER / COMMAND_LOG, "a") as fh:
        fh.write(json.dumps(entry) + "\n")


_depth = threading.local()


@contextlib.contextmanager
def _userspace_lock(root: Path) -> Iterator[None]:
    """One command at a time per host (re-entrant in this thread): dpkg and systemd serialise the same way."""
    level = getattr(_depth, "level", 0)
    if level:
        _depth.level = level + 1
        try:
            yield
        finally:
            _depth.level -= 1
        return
    with open(root / EMULATION_MARKER / LOCK_FILE, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        _depth.level = 1
        try:
            yield
        finally:
            _depth.level = 0
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --- the entry point --------------------------------------------------------------------------------------


def run_emulated(root: Path, argv: tuple[str, ...]) -> CommandResult:
    """Run ``argv`` on the emulated host at ``root``; a failing command does not raise: its exit code says."""
    root = Path(root)
    if not (root / EMULATION_MARKER).is_dir():
        raise FileNotFoundError(errno.ENOENT, "not an emulated host", str(root))
    argv = tuple(argv)
    with _userspace_lock(root):
        fault = _take_fault(root, argv) if argv else None
        with current_command(argv):
            signal_point(root, "start")
            outcome = fault if fault is not None else dispatch(root, argv)
            signal_point(root, "end")
        _log(root, argv, outcome, fault is not None)
    return CommandResult(argv, outcome[0], outcome[1], outcome[2])


def dispatch(root: Path, argv: tuple[str, ...]) -> Outcome:
    """Answer one command, without logging or faults (tools that run other tools call this)."""
    if not argv:
        return 127, "", ": command not found\n"
    name = argv[0]
    handler = _BUILTIN.get(name)
    if handler is None:
        shipped = nvidia_tools.TOOLS.get(os.path.basename(name))
        if shipped is not None and _tool_installed(root, name, shipped[0]):
            handler = shipped[1]
    if handler is None:
        return 127, "", f"{name}: command not found\n"
    return handler(root, list(argv[1:]))


def _tool_installed(root: Path, name: str, path: str) -> bool:
    """A packaged tool runs when its file exists, called by full path or (PATH tools) by bare name."""
    if name.startswith("/"):
        return name.lstrip("/") == path and (root / path).is_file()
    return path.startswith("usr/bin/") and (root / path).is_file()


# --- kernel modules: modprobe, rmmod, lsmod, modinfo ------------------------------------------------------


def _release(root: Path) -> str:
    return EmulatedKernel(root).snapshot().kernel_release


def modprobe(root: Path, args: list[str]) -> Outcome:
    flags = {a for a in args if a.startswith("-")}
    names = [a for a in args if not a.startswith("-")]
    bad = flags - {
        "-r",
        "--remove",
        "-q",
        "--quiet",
        "-a",
        "--all",
        "-v",
        "--verbose",
        "-b",
        "--use-blacklist",
    }
    if bad:
        return 1, "", f"modprobe: unrecognized option '{sorted(bad)[0]}'\n"
    quiet = bool(flags & {"-q", "--quiet"})
    if not names:
        return 1, "", "modprobe: ERROR: missing parameters. See -h.\n"
    if flags & {"-r", "--remove"}:
        return _modprobe_remove(root, names, quiet)
    if not flags & {"-a", "--all"}:
        # without -a the words after the module name are its parameters (name=value)
        params = names[1:]
        names = names[:1]
        if any("=" not in p for p in params):
            name = names[0].replace("-", "_")
            return (
                1,
                "",
                (
                    f"modprobe: ERROR: could not insert '{name}': Unknown symbol in module, or unknown "
                    "parameter (see dmesg)\n"
                ),
            )
    kernel = EmulatedKernel(root)
    release = _release(root)
    known = kmodules.read_modules_dep(root, release)
    for raw in names:
        name = raw.replace("-", "_")
        if name not in known:
            return (
                1,
                "",
                ""
                if quiet
                else f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{release}\n",
            )
        try:
            kernel.load_module(name)
        except OSError as exc:
            reason = (
                "Unknown symbol in module, or unknown parameter (see dmesg)"
                if exc.errno == errno.ENOENT
                else (os.strerror(exc.errno or errno.EIO))
            )
            return 1, "", f"modprobe: ERROR: could not insert '{name}': {reason}\n"
    return 0, "", ""


def _modprobe_remove(root: Path, names: list[str], quiet: bool) -> Outcome:
    kernel = EmulatedKernel(root)
    before = set(kernel.loaded_modules())
    for raw in names:
        name = raw.replace("-", "_")
        snapshot = kernel.snapshot()
        module = snapshot.module(name)
        if module is None:
            if name in before:  # already removed as an unused dependency of an earlier name
                continue
            return 1, "", "" if quiet else f"modprobe: FATAL: Module {name} is not in kernel.\n"
        try:
            kernel.unload_module(name)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return 1, "", f"modprobe: FATAL: Module {name} is in use.\n"
            return 1, "", f"modprobe: FATAL: Module {name}: {os.strerror(exc.errno or errno.EIO)}\n"
        signal_point(root, "middle")  # the module is out, the dependencies it pulled in not yet
        _remove_unused_dependencies(kernel, module.depends)
    return 0, "", ""


def _remove_unused_dependencies(kernel: EmulatedKernel, depends: list[str]) -> None:
    """modprobe -r also removes the dependencies nothing else uses any more (errors there are ignored)."""
    for dep in depends:
        snapshot = kernel.snapshot()
        module = snapshot.module(dep)
        if module is None:
            continue
        try:
            if kernel.module_refcount(dep) == 0:
                kernel.unload_module(dep)
                _remove_unused_dependencies(kernel, module.depends)
        except OSError:
            continue


def rmmod(root: Path, args: list[str]) -> Outcome:
    names = [a for a in args if not a.startswith("-")]
    if not names:
        return 1, "", "rmmod: ERROR: missing module name.\n"
    kernel = EmulatedKernel(root)
    for raw in names:
        name = raw.replace("-", "_")
        snapshot = kernel.snapshot()
        if snapshot.module(name) is None:
            return 1, "", f"rmmod: ERROR: Module {name} is not currently loaded\n"
        try:
            kernel.unload_module(name)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                holders = snapshot.holders_of(name)
                by = f" by: {' '.join(holders)}" if holders else ""
                return 1, "", f"rmmod: ERROR: Module {name} is in use{by}\n"
            return (
                1,
                "",
                f"rmmod: ERROR: could not remove module {name}: {os.strerror(exc.errno or errno.EIO)}\n",
            )
    return 0, "", ""


def lsmod(root: Path, args: list[str]) -> Outcome:
    """Reads ``/proc/modules`` like the real lsmod: name, size, use count, users without trailing comma."""
    lines = ["Module                  Size  Used by"]
    path = root / "proc/modules"
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        users = fields[3].rstrip(",") if fields[3] != "-" else ""
        lines.append(f"{fields[0]:<19} {fields[1]:>8}  {fields[2]} {users}".rstrip())
    return 0, "\n".join(lines) + "\n", ""


def modinfo(root: Path, args: list[str]) -> Outcome:
    field = None
    names: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg in ("-F", "--field"):
            field = next(rest, None)
            if field is None:
                return 1, "", "modinfo: option requires an argument -- 'F'\n"
        elif arg.startswith("--field="):
            field = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            return 1, "", f"modinfo: unrecognized option '{arg}'\n"
        else:
            names.append(arg)
    if not names:
        return 1, "", "modinfo: ERROR: missing module or filename.\n"
    release = _release(root)
    out, err, rc = "", "", 0
    for name in names:
        try:
            mod = kmodules.read_module(root, release, name)
        except OSError:
            err += f"modinfo: ERROR: Module {name} not found.\n"
            rc = 1
            continue
        info = _modinfo_fields(mod, release)
        if field is not None:
            out += "".join(f"{value}\n" for key, value in info if key == field)
        else:
            out += "".join(f"{key + ':':<16}{value}\n" for key, value in info)
    return rc, out, err


def _modinfo_fields(mod: kmodules.ModuleFile, release: str) -> list[tuple[str, str]]:
    info = [("filename", f"/lib/modules/{release}/{mod.path}")]
    if mod.version:
        info.append(("version", mod.version))
    info.append(("license", mod.license))
    for drv in mod.drivers:
        info += [("alias", kmodules._modalias_glob(rule)) for rule in drv.ids if not rule.override_only]
    info += [
        ("depends", ",".join(mod.depends)),
        ("name", mod.name),
        ("vermagic", f"{release} SMP preempt mod_unload modversions"),
    ]
    return info


# --- small tools ------------------------------------------------------------------------------------------


def update_initramfs(root: Path, args: list[str]) -> Outcome:
    if not any(a in ("-u", "-c") for a in args):
        return 1, "", "Usage: update-initramfs {-c|-d|-u} [-k version] [-v] [-b directory]\n"
    release = _release(root)
    image = root / "boot" / f"initrd.img-{release}"
    image.parent.mkdir(parents=True, exist_ok=True)
    image.write_text(f"emulated initramfs for {release}\n")
    return 0, f"update-initramfs: Generating /boot/initrd.img-{release}\n", ""


def driverctl(root: Path, args: list[str]) -> Outcome:
    """driverctl 0.111's set-override / unset-override / list-overrides, through the kernel's own files."""
    words = [a for a in args if not a.startswith("-")]
    noprobe = "--noprobe" in args
    if not words:
        return 1, "", "Usage: driverctl [OPTIONS...] {COMMAND} ...\n"
    verb = words[0]
    store = root / "etc/driverctl.d"
    if verb == "list-overrides":
        lines = sorted(
            f"{p.name.removeprefix('pci-')} {p.read_text().strip()}"
            for p in store.glob("pci-*")
            if p.is_file()
        )
        return 0, "".join(f"{line}\n" for line in lines), ""
    if verb not in ("set-override", "unset-override") or len(words) < 2:
        return 1, "", f"driverctl: unknown command or missing device: {' '.join(words)}\n"
    address = words[1]
    dev = root / "sys/bus/pci/devices" / address
    if not dev.exists():
        return 1, "", f"driverctl: device {address} not found\n"
    drv = words[2] if verb == "set-override" and len(words) > 2 else ""
    if verb == "set-override" and not drv:
        return 1, "", "driverctl: missing driver name\n"
    host = Host(root)
    try:
        if drv and drv != "none" and not (root / "sys/module" / drv.replace("-", "_")).exists():
            dispatch(root, ("modprobe", "-q", drv))
        if (dev / "driver").exists():
            host.write(dev / "driver" / "unbind", address)
        host.write(dev / "driver_override", drv if drv else "\n")
        if not noprobe and drv != "none":
            host.write(root / "sys/bus/pci/drivers_probe", address)
            if drv and not (dev / "driver").exists():
                return 1, "", f"driverctl: failed to bind device {address} to driver {drv}\n"
    except OSError as exc:
        return 1, "", f"driverctl: {exc.filename or address}: {exc.strerror}\n"
    store.mkdir(parents=True, exist_ok=True)
    if drv:
        (store / f"pci-{address}").write_text(drv + "\n")
    else:
        (store / f"pci-{address}").unlink(missing_ok=True)
    return 0, "", ""


def _true(root: Path, args: list[str]) -> Outcome:
    return 0, "", ""


def _false(root: Path, args: list[str]) -> Outcome:
    return 1, "", ""


def _uname(root: Path, args: list[str]) -> Outcome:
    snapshot = EmulatedKernel(root).snapshot()
    if args in ([], ["-s"]):
        return 0, "Linux\n", ""
    if args == ["-r"]:
        return 0, snapshot.kernel_release + "\n", ""
    if args == ["-n"]:
        return 0, snapshot.hostname + "\n", ""
    return 0, f"Linux {snapshot.hostname} {snapshot.kernel_release} x86_64 GNU/Linux\n", ""


_BUILTIN: dict[str, Handler] = {
    "modprobe": modprobe,
    "rmmod": rmmod,
    "lsmod": lsmod,
    "modinfo": modinfo,
    "systemctl": services.systemctl,
    "apt-get": apt.apt_get,
    "apt": apt.apt_get,
    "dpkg-query": apt.dpkg_query,
    "dpkg": apt.dpkg,
    "update-initramfs": update_initramfs,
    "driverctl": driverctl,
    "true": _true,
    "false": _false,
    "uname": _uname,
}
