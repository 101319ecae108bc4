"""One step-state vocabulary (``gpumode.domain.StepState``) for the journal, a server job and the API, and
the run states spelled as a job's are (``rolled_back``): a journal written before, with ``started`` and
``rolled-back``, still reads."""

from __future__ import annotations

import json
from pathlib import Path

from gpumode.domain import Impact, Mode, Plan, Step, StepState, SwitchRequest
from gpumode.host.root import Host
from gpumode.modes.journal import JournalStore, RunState
from gpumode.server.switch import states


def _plan() -> Plan:
    steps = [
        Step(id=f"0{n}-file.set", action="file.set", target=t, params={}) for n, t in ((1, "a"), (2, "b"))
    ]
    return Plan("h", SwitchRequest(Mode.ACCEL), steps, Impact(gpus={"0000:3b:00.0": (Mode.NONE, Mode.ACCEL)}))


def test_journal_job_and_api_share_one_step_vocabulary() -> None:
    assert states.StepState is StepState
    assert StepState.STARTED is StepState.RUNNING  # the journal's old name is the same member
    assert (
        RunState.ROLLED_BACK.value == states.JobState.ROLLED_BACK.value == states.HostState.ROLLED_BACK.value
    )


def test_a_journal_written_before_the_change_still_reads(tmp_path: Path) -> None:
    host = Host(tmp_path)
    journal = JournalStore(host).create(_plan(), "20261130T120000Z-0ld0ld00")
    journal.save()
    body = json.loads(journal.path.read_text())
    body["state"] = "rolling-back"
    body["steps"][0]["state"], body["steps"][0]["touched"] = "started", True
    journal.path.write_text(json.dumps(body))

    found = JournalStore(host).unfinished()
    assert found is not None
    assert found.state is RunState.ROLLING_BACK
    assert [s.state for s in found.steps] == [StepState.RUNNING, StepState.PENDING]
    found.save()  # written back in the one vocabulary
    again = json.loads(found.path.read_text())
    assert again["state"] == "rolling_back" and again["steps"][0]["state"] == "running"

    body["state"] = "rolled-back"
    found.path.write_text(json.dumps(body))
    old = JournalStore(host).unfinished()
    assert old is not None and old.state is RunState.ROLLED_BACK and old.state.finished
