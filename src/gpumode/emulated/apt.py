"""``apt-get``, ``dpkg-query`` and ``dpkg`` of the emulated host, over the catalogue in :mod:`.packages`.

Faithful where gpumode's behaviour depends on it: dependencies are pulled in, reverse dependencies go with a
removed package, a ``Conflicts`` with an installed package fails the way dpkg does (exit 100, nothing
changed), unknown packages fail with apt's message, removal runs the package's ``prerm`` (stop and disable its
units) and leaves loaded kernel modules loaded, and installation enables the units it ships without starting
them.
"""

from __future__ import annotations

from pathlib import Path

from gpumode.emulated import packages, services
from gpumode.emulated.interrupts import signal_point
from gpumode.emulated.packages import CATALOGUE, Outcome, PackageDef

_HEADER = "Reading package lists...\nBuilding dependency tree...\nReading state information...\n"
_APT_OPTIONS = {
    "-y",
    "--yes",
    "--assume-yes",
    "-q",
    "-qq",
    "--quiet",
    "--no-install-recommends",
    "--purge",
    "--allow-downgrades",
    "--reinstall",
}


def apt_get(root: Path, args: list[str]) -> Outcome:
    options = [a for a in args if a.startswith("-")]
    words = [a for a in args if not a.startswith("-")]
    unknown = [o for o in options if o not in _APT_OPTIONS and not o.startswith("-o")]
    if unknown:
        return (
            100,
            "",
            f"E: Command line option '{unknown[0]}' is not understood in combination with the other "
            "options\n",
        )
    if not words:
        return 100, "", "E: No command given. See apt-get --help.\n"
    verb, names = words[0], [n.split("=", 1)[0] for n in words[1:]]
    assume_yes = any(o in ("-y", "--yes", "--assume-yes") for o in options)
    if verb == "update":
        return 0, "Reading package lists...\n", ""
    if verb not in ("install", "remove", "purge"):
        return 100, "", f"E: Invalid operation {verb}\n"
    purge = verb == "purge" or "--purge" in options
    if not names:
        return 0, _HEADER + "0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.\n", ""
    if verb == "install":
        return _install(root, names, assume_yes)
    return _remove(root, names, purge, assume_yes)


def _install(root: Path, names: list[str], assume_yes: bool) -> Outcome:
    missing = [n for n in names if n not in CATALOGUE]
    if missing:
        return 100, _HEADER, f"E: Unable to locate package {missing[0]}\n"
    have = packages.installed(root)
    out = _HEADER
    new: list[PackageDef] = []

    def want(name: str) -> None:
        pkg = CATALOGUE[name]
        for dep in pkg.depends:
            want(dep)
        if name not in have and pkg not in new:
            new.append(pkg)

    for name in names:
        if name in have:
            out += f"{name} is already the newest version ({have[name]}).\n"
        want(name)
    if not new:
        return 0, out + "0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.\n", ""
    extra = [p.name for p in new if p.name not in names]
    if extra:
        out += "The following additional packages will be installed:\n  " + " ".join(extra) + "\n"
    out += "The following NEW packages will be installed:\n  " + " ".join(p.name for p in new) + "\n"
    out += f"0 upgraded, {len(new)} newly installed, 0 to remove and 0 not upgraded.\n"
    if extra and not assume_yes:
        return 1, out + "Do you want to continue? [Y/n] Abort.\n", ""
    # dpkg unpacks one archive at a time; a conflict with an installed package stops it before any change
    for pkg in new:
        clash = next((c for c in pkg.conflicts if c in have), None)
        if clash is None:
            clash = next((c for c in pkg.conflicts if any(p.name == c for p in new)), None)
        if clash is not None:
            version = have.get(clash) or CATALOGUE[clash].version
            archive = f"/var/cache/apt/archives/{pkg.deb}"
            err = (
                f"dpkg: regarding {archive} containing {pkg.name}:\n"
                f" {pkg.name} conflicts with {clash}\n"
                f"  {clash} (version {version}) is present and installed.\n\n"
                f"dpkg: error processing archive {archive} (--unpack):\n"
                f" conflicting packages - not installing {pkg.name}\n"
                f"Errors were encountered while processing:\n {archive}\n"
                "E: Sub-process /usr/bin/dpkg returned an error code (1)\n"
            )
            return 100, out + f"Selecting previously unselected package {pkg.name}.\n", err
    for n, pkg in enumerate(new):
        if n == 1:
            signal_point(root, "middle")  # one archive unpacked, the next not yet
        packages.unpack(root, pkg)
        have[pkg.name] = pkg.version
        out += (
            f"Selecting previously unselected package {pkg.name}.\n"
            f"Preparing to unpack .../{pkg.deb} ...\n"
            f"Unpacking {pkg.name} ({pkg.version}) ...\n"
        )
    err = ""
    for pkg in new:
        out += f"Setting up {pkg.name} ({pkg.version}) ...\n"
        for unit in pkg.units:  # postinst: deb-systemd-helper enable (started by the admin or at boot)
            _rc, _o, e = services.enable(root, unit.name)
            out += e
        if pkg.module_files is not None:
            out += "Loading new nvidia DKMS files...\nBuilding for " + _release_text(root) + "\n"
    return 0, out, err


def _release_text(root: Path) -> str:
    return ", ".join(sorted(p.name for p in (root / "lib/modules").iterdir() if p.is_dir()))


def _remove(root: Path, names: list[str], purge: bool, assume_yes: bool) -> Outcome:
    missing = [n for n in names if n not in CATALOGUE and n not in packages.installed(root)]
    if missing:
        return 100, _HEADER, f"E: Unable to locate package {missing[0]}\n"
    have = packages.installed(root)
    out = _HEADER
    doomed: list[str] = []

    def drop(name: str) -> None:
        if name in doomed or name not in have:
            return
        doomed.append(name)
        for other, pkg in CATALOGUE.items():  # reverse dependencies go too
            if name in pkg.depends:
                drop(other)

    for name in names:
        if name not in have:
            out += f"Package '{name}' is not installed, so not removed\n"
        drop(name)
    if not doomed:
        return 0, out + "0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.\n", ""
    mark = "*" if purge else ""
    out += "The following packages will be REMOVED:\n  " + " ".join(f"{n}{mark}" for n in doomed) + "\n"
    out += f"0 upgraded, 0 newly installed, {len(doomed)} to remove and 0 not upgraded.\n"
    if any(n not in names for n in doomed) and not assume_yes:
        return 1, out + "Do you want to continue? [Y/n] Abort.\n", ""
    for n, name in enumerate(reversed(doomed)):  # dependants first
        if n == 1:
            signal_point(root, "middle")  # one package removed, the next not yet
        pkg = CATALOGUE.get(name)
        out += f"Removing {name} ({have[name]}) ...\n"
        if pkg is None:
            continue
        for unit in pkg.units:  # prerm: stop and disable; loaded modules stay loaded
            services.stop(root, unit.name)
            services.disable(root, unit.name)
        packages.delete(root, pkg, purge=purge)
        if purge:
            out += f"Purging configuration files for {name} ({have[name]}) ...\n"
    return 0, out, ""


# --- dpkg-query / dpkg ------------------------------------------------------------------------------------


def dpkg_query(root: Path, args: list[str]) -> Outcome:
    """``dpkg-query -W [-f FORMAT] [PKG…]`` and ``-s PKG``/``-l``."""
    if "-l" in args or "--list" in args:
        return _list(root, [a for a in args if not a.startswith("-")])
    if "-s" in args or "--status" in args:
        return _status(root, [a for a in args if not a.startswith("-")])
    if not any(a in ("-W", "--show") for a in args):
        return 2, "", "dpkg-query: error: need an action option\n"
    fmt = "${Package}\t${Version}\n"
    names: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg in ("-f", "--showformat"):
            fmt = next(rest, fmt)
        elif arg.startswith("--showformat="):
            fmt = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            names.append(arg)
    stanzas = packages.read_status(root)
    out, err, rc = "", "", 0
    selected = names or sorted(stanzas)
    for name in selected:
        stanza = stanzas.get(name)
        if stanza is None:
            err += f"dpkg-query: no packages found matching {name}\n"
            rc = 1
            continue
        text = fmt.replace("\\n", "\n").replace("\\t", "\t")
        for key, value in stanza.fields.items():
            text = text.replace("${" + key + "}", value)
        text = text.replace("${db:Status-Abbrev}", "ii " if stanza.installed else "rc ")
        out += _blank_unknown_fields(text)
    return rc, out, err


def _blank_unknown_fields(text: str) -> str:
    while "${" in text and "}" in text[text.index("${") :]:
        start = text.index("${")
        end = text.index("}", start)
        text = text[:start] + text[end + 1 :]
    return text


def _status(root: Path, names: list[str]) -> Outcome:
    stanzas = packages.read_status(root)
    out, err, rc = "", "", 0
    for name in names:
        stanza = stanzas.get(name)
        if stanza is None:
            err += f"dpkg-query: package '{name}' is not installed and no information is available\n"
            rc = 1
        else:
            out += stanza.render() + "\n"
    return rc, out, err


def _list(root: Path, names: list[str]) -> Outcome:
    stanzas = packages.read_status(root)
    out = (
        "Desired=Unknown/Install/Remove/Purge/Hold\n"
        "| Status=Not/Inst/Conf-files/Unpacked/halF-conf/Half-inst/trig-aWait/Trig-pend\n"
        "|/ Err?=(none)/Reinst-required (Status,Err: uppercase=bad)\n"
        "||/ Name                     Version                       Architecture Description\n"
        "+++-========================-=============================-============-" + "=" * 40 + "\n"
    )
    selected = names or sorted(stanzas)
    found = False
    for name in selected:
        stanza = stanzas.get(name)
        if stanza is None:
            continue
        found = True
        f = stanza.fields
        state = "ii" if stanza.installed else "rc"
        out += (
            f"{state}  {name:<24} {f.get('Version', ''):<29} {f.get('Architecture', ''):<12} "
            f"{f.get('Description', '').splitlines()[0] if f.get('Description') else ''}\n"
        )
    if names and not found:
        return 1, "", f"dpkg-query: no packages found matching {' '.join(names)}\n"
    return 0, out, ""


def dpkg(root: Path, args: list[str]) -> Outcome:
    """``dpkg -l`` / ``dpkg -s`` (``dpkg`` hands those to dpkg-query)."""
    if any(a in ("-l", "--list", "-s", "--status") for a in args):
        return dpkg_query(root, args)
    return 2, "", "dpkg: error: only -l and -s are available on this emulated host\n"
