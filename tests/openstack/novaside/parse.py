"""nova's own reading of a nova-compute configuration, for comparing gpumode's merge rules with it: nova's
option definitions (``nova.conf``) parsed by oslo.config from the given files and directories in
nova-compute's order, then ``[pci] device_spec`` through ``nova.pci.whitelist`` and ``[pci] alias`` through
``nova.pci.request``. Run by the nova venv's python:

    python parse.py REQUEST.json RESULT.json

REQUEST: a list of ``{config_files, config_dirs}``. RESULT: one entry each: ``ok``, ``error`` (nova's message
when a value does not parse), and the effective values gpumode's modes depend on."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any


def parse(request: dict[str, Any]) -> dict[str, Any]:
    from nova import conf
    from nova.conf import devices
    from nova.pci import request as pci_request
    from nova.pci import whitelist

    CONF = conf.CONF
    CONF.reset()
    args = [f"--config-file={f}" for f in request["config_files"]]
    args += [f"--config-dir={d}" for d in request["config_dirs"]]
    CONF(args, project="nova", default_config_files=[], default_config_dirs=[])
    types = list(CONF.devices.enabled_mdev_types)
    devices.register_dynamic_opts(CONF)  # [mdev_<type>] groups, as the libvirt driver registers them
    addresses = {t: list(getattr(CONF, f"mdev_{t}").device_addresses or []) for t in types}
    specs = list(CONF.pci.device_spec)
    result: dict[str, Any] = {
        "enabled_mdev_types": types,
        "device_addresses": addresses,
        "device_spec": [d for s in specs for d in _specs(json.loads(s))],
        "alias": [json.loads(a) for a in CONF.pci.alias],
        "report_in_placement": bool(CONF.pci.report_in_placement),
    }
    try:
        whitelist.Whitelist(
            specs
        )  # nova-compute's parse of every spec: the PCI tracker refuses to start on error
        pci_request.get_alias_from_config()  # nova-api's and nova-compute's parse of the aliases
    except Exception as exc:  # nova's own error types; the message is what an operator would read in its log
        return {**result, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {**result, "ok": True, "error": ""}


def _specs(data: Any) -> list[Any]:
    return data if isinstance(data, list) else [data]


def main() -> int:
    with open(sys.argv[1]) as f:
        requests = json.load(f)
    results = []
    for request in requests:
        try:
            results.append(parse(request))
        except Exception:
            results.append({"ok": False, "error": traceback.format_exc()})
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
