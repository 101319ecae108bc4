"""`gpumode plan | apply | assert | status` on emulated hosts, in-process (Typer's runner) for speed.

Bad input must give exit 2, a message naming what was wrong, and leave every byte under the root as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_support import make_host, tree_digest
from typer.testing import CliRunner

from gpumode.cli.main import app
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.modes.journal import HostLock

runner = CliRunner()


def gpumode(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def l40s(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return make_host(tmp_path_factory.mktemp("l40s") / "h", "l40s-sriov")


@pytest.fixture(scope="module")
def hgx(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return make_host(tmp_path_factory.mktemp("hgx") / "h", "hgx-h100")


def first_gpu(host: Host) -> str:
    return discover(host).gpus[0].address


BAD_INPUTS = [
    (["--mode", "turbo"], "unknown mode 'turbo'"),
    (["--mode", "none"], "unknown mode 'none'"),
    (["--mode", "vgpu", "--vgpu-type", "NOPE-9Q"], "NOPE-9Q"),
    (["--mode", "vgpu", "--vgpu-type", "L40S-48Q", "--count", "999"], "999"),
    (["--mode", "accel", "--gpu", "0000:ff:00.0"], "no GPU 0000:ff:00.0"),
    (["--mode", "accel", "--gpu", "not-an-address"], "not a PCI address"),
    (["--mode", "accel", "--vm-policy", "maybe"], "unknown VM policy 'maybe'"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
@pytest.mark.parametrize("verb", ["plan", "apply"])
def test_bad_input_is_refused_and_changes_nothing(
    l40s: Host, verb: str, args: list[str], message: str
) -> None:
    before = tree_digest(l40s.root)
    extra = ["--yes"] if verb == "apply" else []
    code, out = gpumode(verb, *args, *extra, "--root", str(l40s.root))
    assert code == 2, out
    assert message.lower() in out.lower(), out
    assert tree_digest(l40s.root) == before


def test_mode_off_the_whitelist_is_refused(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "l40s-sriov")
    whitelist = host.path("etc/gpumode/whitelist.yaml")
    whitelist.parent.mkdir(parents=True, exist_ok=True)
    whitelist.write_text("version: v1\nplatform:\n  modes: [accel, passthrough]\n")
    before = tree_digest(host.root)
    code, out = gpumode("apply", "--mode", "vgpu", "--yes", "--root", str(host.root))
    assert code == 2 and "vgpu" in out, out
    assert tree_digest(host.root) == before


def test_accel_next_to_vgpu_is_refused(hgx: Host) -> None:
    """The data-center driver and the vGPU manager are one module: one GPU cannot go vgpu while others are
    accel."""
    before = tree_digest(hgx.root)
    gpus = discover(hgx).gpus
    assert len(gpus) > 1
    code, out = gpumode("apply", "--mode", "vgpu", "--gpu", gpus[0].address, "--yes", "--root", str(hgx.root))
    assert code == 2, out
    assert tree_digest(hgx.root) == before


def test_option_combinations_are_checked(l40s: Host) -> None:
    before = tree_digest(l40s.root)
    root = str(l40s.root)
    for args in (
        ["apply", "--root", root],
        ["apply", "--resume", "--mode", "accel", "--root", root],
        ["apply", "--resume", "--rollback", "--root", root],
        ["apply", "--from-desired", "--gpu", first_gpu(l40s), "--root", root],
    ):
        code, out = gpumode(*args)
        assert code == 2, (args, out)
    assert tree_digest(l40s.root) == before


def test_plan_json_lists_steps_and_impact(l40s: Host) -> None:
    code, out = gpumode("plan", "--mode", "passthrough", "--root", str(l40s.root), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["request"]["mode"] == "passthrough"
    assert any(s["action"] == "bind.vfio" for s in data["steps"])
    assert set(data["impact"]["gpus"]) == {g.address for g in discover(l40s).gpus}


def test_plan_table_and_apply_then_assert_and_status(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    root = str(host.root)
    code, out = gpumode("plan", "--mode", "passthrough", "--root", root)
    assert code == 0 and "bind.vfio" in out and "impact" in out, out
    code, out = gpumode("assert", "--mode", "passthrough", "--root", root)
    assert code == 1 and "expected passthrough" in out, out
    code, out = gpumode("apply", "--mode", "passthrough", "--yes", "--root", root)
    assert code == 0 and "done" in out, out
    code, out = gpumode("assert", "--mode", "passthrough", "--root", root)
    assert code == 0, out
    code, out = gpumode("status", "--root", root, "--json")
    assert code == 0, out
    st = json.loads(out)
    assert {g["mode"] for g in st["gpus"]} == {"passthrough"}
    assert {g["desired"]["mode"] for g in st["gpus"]} == {"passthrough"}
    assert st["unfinished"] is None and st["last"]["state"] == "done"
    code, out = gpumode("apply", "--resume", "--root", root)
    assert code == 0 and "no unfinished run" in out


def test_apply_without_yes_off_a_terminal_changes_nothing(l40s: Host) -> None:
    before = tree_digest(l40s.root)
    code, out = gpumode("apply", "--mode", "passthrough", "--root", str(l40s.root))
    assert code == 2 and "--yes" in out, out
    assert tree_digest(l40s.root) == before


def test_a_second_runner_is_refused(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    with HostLock(host):
        code, out = gpumode("apply", "--mode", "passthrough", "--yes", "--root", str(host.root))
    assert code == 3 and "another gpumode runner" in out, out


def _unfinished(host: Host, mode: str) -> str:
    """A run planned and journalled but not run, as a kill right after the journal was written leaves it."""
    from gpumode.modes import engine
    from gpumode.modes.journal import JournalStore
    from gpumode.modes.policy import parse_request

    plan = engine.plan(host, parse_request(mode=mode, vm_policy="all"))
    return JournalStore(host).create(plan, engine.new_plan_id(plan)).plan_id


def test_resume_and_rollback_are_verbs_of_their_own(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    root = str(host.root)
    for verb in ("resume", "rollback"):
        code, out = gpumode(verb, "--help")
        assert code == 0 and "unfinished run" in out and "--mode" not in out, out
        code, out = gpumode(verb, "--root", root)
        assert code == 0 and "no unfinished run" in out, out
    plan_id = _unfinished(host, "passthrough")
    code, out = gpumode("status", "--root", root)
    assert "`gpumode resume` finishes it, `gpumode rollback` undoes it" in out, out
    code, out = gpumode("resume", "--root", root)
    assert code == 0 and f"run {plan_id} done" in out, out
    assert gpumode("assert", "--mode", "passthrough", "--root", root)[0] == 0
    _unfinished(host, "accel")
    code, out = gpumode("rollback", "--root", root, "--json")
    assert code == 0 and json.loads(out)[0]["state"] == "rolled_back", out
    assert gpumode("assert", "--mode", "passthrough", "--root", root)[0] == 0


@pytest.mark.parametrize("flag", ["--resume", "--rollback"])
def test_apply_resume_and_rollback_still_work_with_a_notice(tmp_path: Path, flag: str) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    _unfinished(host, "passthrough")
    result = CliRunner().invoke(app, ["apply", flag, "--root", str(host.root)], env={"COLUMNS": "200"})
    verb = flag.removeprefix("--")
    assert result.exit_code == 0, result.output
    assert f"`gpumode apply {flag}` is deprecated; use `gpumode {verb}`" in result.stderr
    assert ("done" if verb == "resume" else "rolled back") in result.stdout
