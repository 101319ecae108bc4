"""``gpumode agent``: the host daemon.

Start: use the stored node token, or join with the join token given (and store what the server returns);
settle a job a crash interrupted; re-apply the desired state (at boot the kernel has forgotten VFs, vGPUs and
vfio bindings); report the host. Then, until SIGTERM/SIGINT: report in the background (at once on a change),
long-poll for work, run each job with the engine. A stop signal lets the current step finish; the job's
journal resumes at the next start.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gpumode.agent import config as agent_config
from gpumode.agent.client import ApiError, Client, Stopped
from gpumode.agent.credentials import NodeCredentials
from gpumode.agent.executor import JobRunner
from gpumode.agent.report import SnapshotReporter, look
from gpumode.host.root import Host
from gpumode.modes import engine

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """The agent cannot start (no token, joining refused); the message says what to do."""


@dataclass(frozen=True, slots=True)
class AgentOptions:
    server: str
    token: str | None
    root: Path
    interval_s: float = 60.0
    check_s: float = 5.0
    wait_s: float = 25.0
    max_backoff_s: float = 30.0
    apply_desired: bool = True
    ca: Path | None = None  # verify the server against this CA bundle instead of the system store


class Agent:
    def __init__(self, options: AgentOptions) -> None:
        self.options = options
        self.host = Host(options.root)
        self.stop = threading.Event()
        self._busy = threading.Event()  # a job is running: a stop signal waits for its step boundary
        self.node = ""
        self.client: Client | None = None

    # --- lifecycle ------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; 0 after a clean stop."""
        self._install_signals()
        try:
            client = self.connect()
            reporter = SnapshotReporter(
                self.host,
                client,
                self.node,
                interval_s=self.options.interval_s,
                check_s=self.options.check_s,
                stop=self.stop,
            )
            runner = JobRunner(self.host, client, reporter, self.stop)
            self._guarded(runner.recover)
            if self.options.apply_desired:
                self._apply_desired()
            try:
                reporter.report(force=True)
            except ApiError as exc:  # the report loop tries again; the agent still takes work
                log.error("the server refused the report: %s", exc)
            reporter.start()
            log.info("agent of %s ready; waiting for work from %s", self.node, self.options.server)
            while not self.stop.is_set():
                try:
                    work = client.work(self.node, self.options.wait_s)
                except ApiError as exc:  # a refused token is retried inside; this is anything else
                    log.error(
                        "asking for work was refused: %s; asking again in %gs",
                        exc,
                        self.options.max_backoff_s,
                    )
                    self.stop.wait(self.options.max_backoff_s)
                    continue
                if work is None or self.stop.is_set():
                    continue
                self._busy.set()
                try:
                    self._guarded(lambda w=work: runner.run(w))
                finally:
                    self._busy.clear()
            reporter.join(timeout=5.0)
        except (Stopped, _Interrupted):
            pass
        finally:
            if self.client is not None:
                self.client.close()
        log.info("agent stopped")
        return 0

    def _guarded(self, action: object) -> None:
        """Run a job action; an error is logged and the agent goes on (the next poll or start retries)."""
        assert callable(action)
        try:
            action()
        except (Stopped, _Interrupted):
            raise
        except ApiError as exc:
            log.error("the server refused: %s", exc)
        except Exception:
            log.exception("running a job failed")

    def _client(self, server: str, token: str) -> Client:
        """The client every later call goes through: a refused token is retried, not fatal."""
        credentials = NodeCredentials(self.host, server, self.node, token)
        self.client = Client(
            server, token, stop=self.stop, max_backoff_s=self.options.max_backoff_s,
            credentials=credentials, ca=self.options.ca,
        )
        return self.client

    def connect(self) -> Client:
        """A client with a node token: the stored one, or a fresh one from joining. Given a join token as
        well, the stored token is tried first and the agent joins only if the server no longer accepts it
        (revoked, or the node taken over): how an agent is given a new token."""
        stored = agent_config.load(self.host)
        server = self.options.server.rstrip("/")
        token = self.options.token
        if stored is not None and stored.server == server and (token is None or token.startswith("gpmj_")):
            if token is None or self._still_accepted(server, stored):
                self.node = stored.node
                log.info("using the node token stored in %s", agent_config.config_path(self.host))
                return self._client(server, stored.token)
            log.warning("the server refuses the stored node token; joining with the join token given")
        if token is None:
            raise AgentError(
                "no node token stored for this server: pass --token with a join token (gpmj_...)"
            )
        if token.startswith("gpmn_"):  # a node token given directly: use it as is
            self.node = look(self.host).snapshot.hostname
            return self._client(server, token)
        view = look(self.host)
        joiner = Client(
            server, token, stop=self.stop, max_backoff_s=self.options.max_backoff_s, ca=self.options.ca
        )
        try:
            # A node token stored for another server address may still be this node's: it proves a re-join.
            proof = stored.token if stored is not None and stored.node == view.snapshot.hostname else None
            answer = joiner.join(view.snapshot.hostname, view.body(), node_token=proof)
        except ApiError as exc:
            raise AgentError(f"joining {server} failed: {exc}") from exc
        finally:
            joiner.close()
        self.node = str(answer["node"])
        path = agent_config.save(self.host, agent_config.AgentConfig(server, self.node, str(answer["token"])))
        log.info("joined %s as node %s; node token stored in %s", server, self.node, path)
        return self._client(server, str(answer["token"]))

    def _still_accepted(self, server: str, stored: agent_config.AgentConfig) -> bool:
        """Whether the server still takes the stored node token (waiting while the server is away)."""
        probe = Client(
            server, stored.token, stop=self.stop, max_backoff_s=self.options.max_backoff_s, ca=self.options.ca
        )
        try:
            probe.call("GET", f"/nodes/{stored.node}")
        except ApiError as exc:
            if exc.status in (401, 403):
                return False
            raise AgentError(f"checking the stored node token with {server} failed: {exc}") from exc
        finally:
            probe.close()
        return True

    def _apply_desired(self) -> None:
        """Bring every GPU back to its desired mode before taking work (after a reboot it is not)."""
        try:
            results = engine.apply_desired(self.host)
        except Exception as exc:  # the agent must still come up and report, so an operator can see and fix it
            log.error("re-applying the desired state failed: %s", exc)
            return
        for result in results:
            changed = sum(1 for s in (result.run.steps if result.run else []) if s.state.value == "done")
            if not result.ok:
                log.error("re-applying the desired state failed: %s", result.run.error if result.run else "?")
            elif changed:
                log.info("re-applied the desired state: %d step(s) done", changed)

    # --- signals --------------------------------------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (tests): the caller sets ``stop``
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info(
            "%s: stopping%s",
            signal.Signals(signum).name,
            " after the current step" if self._busy.is_set() else "",
        )
        self.stop.set()
        if not self._busy.is_set():
            raise _Interrupted  # leave a long poll or a backoff wait now; nothing is half done


class _Interrupted(BaseException):
    """Raised from the signal handler while idle, to leave a blocking call at once."""
