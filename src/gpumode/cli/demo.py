"""``gpumode demo``: the whole method on emulated hosts, narrated as it happens; then a server to explore.

1. a server on SQLite (a temporary directory, or ``--dir``) on a free loopback port;
2. emulated hosts: an HGX H100 in accel with VMs, an L40S SR-IOV host in vGPU, an RTX workstation in
   passthrough;
3. one ``gpumode agent`` per host joins and reports: nodes, GPUs and cards appear (method step 1);
4. the whitelist narrows a GPU model, and a request outside it is refused (step 2);
5. a dry run shows the plan and impact of switching the HGX from accel to vGPU (steps 3-6, planned);
6. the switch runs as a job on the agent, step by step, live (steps 4-7);
7. a GPU whose card a VM holds is pulled from its host: the card becomes ``lost`` and an alarm is raised;
8. the final inventory is checked against the hosts themselves.

Then the server keeps running (URL and an admin token printed) until Ctrl-C, or the demo ends at once with
``--exit-after``. Exit status: 0 when every stage did what it should, 1 otherwise.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from gpumode.cli import render
from gpumode.cli.client import Client, ClientConfig, RemoteError

if TYPE_CHECKING:
    from gpumode.cli.demo_stack import DemoStack
    from gpumode.emulated.hypervisor import EmulatedHypervisor
    from gpumode.host.root import Host

T = TypeVar("T")

HGX, L40S, WORKSTATION = "hgx-h100-01", "l40s-node-03", "ws-cad-12"
HGX_VGPU_TYPE, HGX_VGPU_COUNT = "NVIDIA H100XM-20C", 2
RTX6000_MODEL = "10de:1e30"
WAIT_S = 60.0  # any one stage; the whole demo takes ~30 s on two cores


class StageFailed(RuntimeError):
    """A stage of the walkthrough did not end as it should; the message says what was seen."""


def demo(
    directory: Path | None = typer.Option(
        None, "--dir", help="Keep the state here (a new or empty directory) [default: a temporary one]."
    ),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Loopback port [default: a free one]."),
    exit_after: bool = typer.Option(
        False, "--exit-after", help="Stop right after the walkthrough instead of serving until Ctrl-C."
    ),
) -> None:
    """Run the whole method on emulated hosts: a server, agents, a live switch and a pulled GPU."""
    from gpumode.cli.demo_stack import DemoError, DemoStack
    from gpumode.cli.localserver import LocalServerError, quiet_server_logs

    # Piped or captured output still gets tables wide enough to read.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    quiet_server_logs()
    temporary = directory is None
    where = Path(tempfile.mkdtemp(prefix="gpumode-demo-")) if directory is None else directory
    stack = DemoStack(where, port=port)
    ok = False
    try:
        with _sigterm_as_interrupt():
            Walkthrough(console, stack).run()
            ok = True
            if not exit_after:
                _serve_until_interrupted(console, stack)
    except (DemoError, LocalServerError, StageFailed, RemoteError) as exc:
        Console(stderr=True, highlight=False).print(f"[bold red]demo failed:[/] {exc}", soft_wrap=True)
    except KeyboardInterrupt:
        console.print("\ninterrupted")
    finally:
        started = stack.credentials is not None
        if started:
            console.print("[dim]stopping the agents and the server…[/]")
        stack.stop()
        if temporary:
            shutil.rmtree(where, ignore_errors=True)
        elif started:
            console.print(f"[dim]state kept in {where}[/]")
    if not ok:
        raise typer.Exit(1)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """``kill`` stops the demo as cleanly as Ctrl-C does."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread (embedded use): nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_until_interrupted(console: Console, stack: DemoStack) -> None:
    console.rule("[bold]the server keeps running")
    console.print(f"Dashboard:  [bold]{stack.url}/ui/[/]  (sign in with the admin token)")
    console.print(f"Admin token: [bold]{stack.admin_token}[/]")
    console.print(f"API docs:   {stack.url}/api/v1/docs")
    console.print("Try, in another terminal:")
    console.print(f"  export GPUMODE_SERVER={stack.url} GPUMODE_TOKEN={stack.admin_token}")
    back = {"mode": "accel", "vm_policy": "all"}
    for line in (
        "gpumode nodes",
        "gpumode gpus --node l40s-node-03",
        "gpumode cards --status lost",
        "gpumode card release ID            # the lost card's id, from the line above",
        switch_command(HGX, back, "--dry-run"),
        switch_command(HGX, back, "--wait"),
        "gpumode events",
    ):
        console.print(f"  {line}")
    console.print("Press Ctrl-C to stop.")
    while True:
        time.sleep(1.0)
        stack.check_agents()


class Walkthrough:
    """The narrated stages; each prints what it does, does it through the API, and checks the outcome."""

    def __init__(self, console: Console, stack: DemoStack) -> None:
        self.console = console
        self.stack = stack
        self.client: Client | None = None
        self.stage = 0
        self.started = time.monotonic()

    @property
    def api(self) -> Client:
        assert self.client is not None
        return self.client

    def run(self) -> None:
        try:
            self.control_plane()
            self.hosts()
            self.agents_join()
            self.whitelist()
            self.dry_run()
            self.switch()
            self.pull_gpu()
            self.final_inventory()
        finally:
            if self.client is not None:
                self.client.close()

    # --- helpers ------------------------------------------------------------------------------------------

    def title(self, text: str, why: str) -> None:
        self.stage += 1
        self.console.print()
        self.console.rule(f"[bold]{self.stage}. {text}", align="left")
        self.console.print(why, style="dim")

    def say(self, text: str) -> None:
        self.console.print(text)

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout_s: float = WAIT_S) -> T:
        """Poll ``probe`` until it returns something; agents are checked alive meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self.console.status(what):
            while True:
                found = probe()
                if found is not None and found is not False:
                    return found
                self.stack.check_agents()
                if time.monotonic() > deadline:
                    raise StageFailed(f"timed out after {timeout_s:g} s: {what}")
                time.sleep(0.25)

    # --- stages -------------------------------------------------------------------------------------------

    def control_plane(self) -> None:
        self.title(
            "control plane",
            "The gpumode server keeps the inventory, the cloud's cards, the whitelist and the switch jobs.",
        )
        self.stack.start_server()
        self.client = Client(ClientConfig(self.stack.url, self.stack.admin_token, "demo", "demo"))
        self.say(f"server on [bold]{self.stack.url}[/] (SQLite: {self.stack.directory / 'gpumode.db'})")

    def hosts(self) -> None:
        from gpumode.cli.demo_stack import DEFAULT_FIXTURES
        from gpumode.emulated.hypervisor import EmulatedHypervisor
        from gpumode.host.discover import discover

        self.title(
            "hosts",
            "Emulated hosts: directories laid out like a real host's /sys, with a kernel answering writes.",
        )
        table = Table(title_justify="left")
        for column in ("host", "fixture", "GPUs", "mode", "VMs (running)"):
            table.add_column(column)
        for fixture in DEFAULT_FIXTURES:
            demo_host = self.stack.create_host(fixture)
            snap = discover(demo_host.host)
            vms = EmulatedHypervisor(demo_host.host).list_vms()
            running = [vm.name for vm in vms if vm.running]
            modes = sorted({g.mode.value for g in snap.gpus})
            table.add_row(
                demo_host.hostname,
                fixture,
                f"{len(snap.gpus)} × {snap.gpus[0].name}" if snap.gpus else "0",
                render.styled(modes[0] if len(modes) == 1 else "mixed", render.MODE_STYLE),
                f"{len(vms)} ({', '.join(running) or 'none'})",
            )
        self.console.print(table)

    def agents_join(self) -> None:
        self.title(
            "agents join: hardware monitoring (method step 1)",
            "Each agent reads its host's PCI devices from sysfs and reports a snapshot; the server diffs it "
            "with the last one and keeps one card per accel GPU, vGPU or passthrough GPU.",
        )
        for hostname in self.stack.hosts:
            self.stack.start_agent(hostname)
            self.say(f"started gpumode agent for {hostname}")
        names = set(self.stack.hosts)

        def all_joined() -> list[dict[str, Any]] | None:
            nodes: list[dict[str, Any]] = self.api.get("/nodes")
            return nodes if {n["name"] for n in nodes} >= names else None

        nodes = self.wait_for("waiting for the agents to join…", all_joined)
        self.console.print(render.nodes_table(nodes))
        details = [self.api.get(f"/nodes/{n}") for n in sorted(names)]
        self.console.print(render.gpus_table(details, title="GPUs (as the server sees them)"))
        self.say("cards:")
        self.console.print(render.card_summary(self.api.get("/cards")))

    def whitelist(self) -> None:
        self.title(
            "the whitelist (method step 2)",
            "The platform enables modes; host groups and GPU models narrow them. A switch may only name an "
            "enabled mode.",
        )
        doc = self.api.get("/modes")
        doc["models"][RTX6000_MODEL] = ["accel", "passthrough"]
        self.console.print(render.whitelist_view(self.api.put("/modes", doc)))
        self.say(f"Quadro RTX 6000 ({RTX6000_MODEL}) may not run vGPU here; asking anyway:")
        refused = {"mode": "vgpu"}
        self.say(f"  $ {switch_command(WORKSTATION, refused, '--dry-run')}")
        try:
            self.api.request("POST", f"/nodes/{WORKSTATION}/switch", params={"dry_run": "true"},
                             json=refused)  # fmt: skip
        except RemoteError as exc:
            if exc.status != 422:
                raise
            self.say(f"  [red]refused[/] {exc}")
            return
        raise StageFailed("the server accepted a switch to a mode the whitelist excludes")

    def _switch_body(self) -> dict[str, Any]:
        return {"mode": "vgpu", "vgpu_type": HGX_VGPU_TYPE, "vgpu_count": HGX_VGPU_COUNT, "vm_policy": "all"}

    def dry_run(self) -> None:
        self.title(
            f"dry run: {HGX} from accel to vGPU",
            "The server checks the driver state it was reported (step 4) and plans the transition (step 6): "
            "shut down the VMs, disable accel mode, replace the driver, create the vGPUs, register the "
            "cards (step 7). Nothing runs yet.",
        )
        self.say(f"  $ {switch_command(HGX, self._switch_body(), '--dry-run')}")
        answer = self.api.request(
            "POST", f"/nodes/{HGX}/switch", params={"dry_run": "true"}, json=self._switch_body()
        )
        self.console.print(render.plan_summary(answer["plan"]))

    def switch(self) -> None:
        from gpumode.cli.remote_jobs import follow

        self.title(
            f"switch: {HGX} to vGPU",
            "The job goes to the host's agent, which runs the host steps with a journal and reports each "
            "one; the server then registers the vGPU cards.",
        )
        self.say(f"  $ {switch_command(HGX, self._switch_body(), '--wait')}")
        job = self.api.post(f"/nodes/{HGX}/switch", self._switch_body())
        final = follow(self.api, job["id"], self.console, timeout_s=WAIT_S * 2)
        if final["state"] != "succeeded":
            raise StageFailed(f"job {final['id']} ended {final['state']}: {final.get('error')}")
        node = self.wait_for(
            f"waiting for {HGX} to report vGPU mode…",
            lambda: (n := self.api.get(f"/nodes/{HGX}"))["mode"] == "vgpu" and n,
        )
        self.say(f"job {final['id']} [green]succeeded[/]: {HGX} is now in [magenta]{node['mode']}[/] mode")
        vms = {vm.name: vm.running for vm in _hypervisor(self.stack.hosts[HGX].host).list_vms()}
        self.say(
            f"VMs on {HGX}: " + ", ".join(f"{n} ({'running' if r else 'shut off'})" for n, r in vms.items())
        )
        self.console.print(render.card_summary(self.api.get("/cards", node=HGX)))

    def pull_gpu(self) -> None:
        self.title(
            f"a GPU is pulled from {WORKSTATION}",
            "Its passthrough card is held by VM win11-cad. The VM is shut off (its allocation stays) and "
            "the GPU drops off the bus. The next report no longer has it: a free card would simply be "
            "removed, a held one is kept as lost and raises an alarm.",
        )
        cards = self.api.get("/cards", node=WORKSTATION)
        if len(cards) != 1:
            raise StageFailed(f"{WORKSTATION} should have one passthrough card, the server has {len(cards)}")
        card = cards[0]  # the server set it from the VMs the agent reports: in use by the running VM
        self.say(f"card {card['id']} ({card['kind']} {card['gpu']}) is {card['status']} by {card['holder']}")
        host = self.stack.hosts[WORKSTATION].host
        _hypervisor(host).shutdown("win11-cad")
        address = card["gpu"]
        host.write(host.path("sys/bus/pci/devices", address, "remove"), "1")
        self.say(f"  # echo 1 > /sys/bus/pci/devices/{address}/remove")

        def alarm() -> list[dict[str, Any]] | None:
            events: list[dict[str, Any]] = self.api.get("/events", node=WORKSTATION, limit=20)
            return events if any(e["kind"] == "alarm.card_lost" for e in events) else None

        events = self.wait_for("waiting for the agent's next report…", alarm)
        since = [e for e in events if e["id"] > max((e["id"] for e in events if e["kind"] == "card.added"),
                                                    default=0)]  # fmt: skip
        self.console.print(render.events_table(since, title=f"events on {WORKSTATION}"))
        lost = self.api.get("/cards", node=WORKSTATION, status="lost")
        if len(lost) != 1:
            raise StageFailed(f"expected the held card to be lost, the server has {lost}")
        self.console.print(render.cards_table(lost, title="lost cards"))

    def final_inventory(self) -> None:
        from gpumode.host.discover import discover

        self.title(
            "final inventory",
            "What the server holds, checked against each host's own sysfs.",
        )
        nodes = self.api.get("/nodes")
        self.console.print(render.nodes_table(nodes))
        self.console.print(render.card_summary(self.api.get("/cards")))
        problems = []
        for hostname, demo_host in self.stack.hosts.items():
            snap = discover(demo_host.host)
            served = self.api.get(f"/nodes/{hostname}")
            ours = sorted((g.address, g.mode.value) for g in snap.gpus)
            theirs = sorted((g["address"], g["mode"]) for g in served["gpus"])
            if ours != theirs or served["fingerprint"] != snap.fingerprint:
                problems.append(f"{hostname}: server has {theirs}, host has {ours}")
        if problems:
            raise StageFailed("; ".join(problems))
        elapsed = time.monotonic() - self.started
        self.say(
            f"[green]✔[/] the server's inventory matches all {len(nodes)} hosts "
            f"(walkthrough: {elapsed:.0f} s)"
        )


def switch_command(node: str, body: dict[str, Any], *flags: str) -> str:
    """The ``gpumode switch`` line that sends ``body``: what the demo prints is what it runs."""
    options = {
        "mode": "--mode",
        "vgpu_type": "--vgpu-type",
        "vgpu_count": "--count",
        "vm_policy": "--vm-policy",
    }
    unknown = set(body) - set(options)
    assert not unknown, f"no switch option for {unknown}"
    parts = ["gpumode", "switch", node]
    for key, option in options.items():
        if key in body:
            parts += [option, shlex.quote(str(body[key]))]
    return " ".join([*parts, *flags])


def _hypervisor(host: Host) -> EmulatedHypervisor:
    from gpumode.emulated.hypervisor import EmulatedHypervisor

    return EmulatedHypervisor(host)
