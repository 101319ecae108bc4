"""The boot display GPU through the API: `boot_vga` travels in the snapshot, passthrough of it is refused with
code `boot_vga` unless the request says `allow_boot_vga`, and the plan then says the console goes dark."""

from __future__ import annotations

from typing import Any

from .builders import host
from .conftest import Api

GPU = "0000:1b:00.0"


def console_host(name: str) -> dict[str, Any]:
    return host(name, 1, changes={GPU: {"boot_vga": True}}).to_dict()


def test_passthrough_of_the_boot_display_needs_allow_boot_vga(api: Api) -> None:
    api.join("n1", snapshot=console_host("n1"))
    dry = {"dry_run": "true"}
    r = api.call("POST", "/nodes/n1/switch", api.admin, json={"mode": "passthrough"}, params=dry)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["code"] == "boot_vga" and GPU in r.json()["detail"]["message"]
    body = {"mode": "passthrough", "allow_boot_vga": True}
    r = api.call("POST", "/nodes/n1/switch", api.admin, json=body, params=dry)
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["request"]["allow_boot_vga"] is True
    assert any("console goes dark" in note for note in plan["impact"]["notes"])
