"""SkyFed from Python: a whole local federation in one call, or the server and agent daemons on threads.

Everything here runs what the ``skyfed`` command runs: ``run_federation`` is ``skyfed sim`` (``sim.run``),
``Server`` and ``Agent`` are the daemons of ``skyfed server run`` and ``skyfed agent run`` on their config
files, ``read_metrics`` reads the server's ``metrics.jsonl``. A bad config raises ``ConfigError`` naming the
key, as the commands print it. docs/api.md shows it in use, and how it maps onto Flower's entry points.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from protocol.config import ConfigError
from protocol.config_check import DaemonConfig
from protocol.messages import MessageError, RoundMetrics
from protocol.peer_messages import PeerRoundMetrics
from sim.federation import FederationLayout, SimSettings, create_federation
from sim.peer_federation import create_peer_federation
from sim.run import SimResult, logged_rounds, run_sim

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from broker_server.config import ServerConfig
    from protocol.daemon import Daemon

__all__ = ["Agent", "ConfigError", "FederationLayout", "RoundMetrics", "Server", "SimResult", "SimSettings",
           "local_broker", "read_metrics", "run_federation", "write_federation"]  # fmt: skip

C = TypeVar("C", bound=DaemonConfig)
D = TypeVar("D", bound="_DaemonThread")
STOP_TIMEOUT_S = 15.0  # a daemon stops within a second or two of being asked (protocol.daemon); a training child's
# job may take longer to cancel


def settings_of(settings: SimSettings | None, overrides: dict[str, object]) -> SimSettings:
    """``SimSettings(**overrides)`` (``agents=2, rounds=1, …``), or ``settings`` with ``overrides`` replaced; an
    unknown name is a ``TypeError`` listing the known ones, a bad value the ``ValueError`` ``skyfed sim`` prints."""
    known = {f.name for f in dataclasses.fields(SimSettings)}
    if unknown := sorted(set(overrides) - known):
        raise TypeError(f"unknown SimSettings field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return SimSettings(**overrides) if settings is None else dataclasses.replace(settings, **overrides)


def run_federation(settings: SimSettings | None = None, *, out: str | Path = "skyfed-run", broker: str | None = None,
                   echo: Callable[[str], object] | None = print, **overrides: object) -> SimResult:  # fmt: skip
    """Run a local federation to its end, as ``skyfed sim``: a broker (``broker``: ``HOST:PORT`` of a running
    one, else mosquitto is started), the server and every agent as the real daemons, in processes of their own.
    Returns the rounds' metrics, the final model's evaluation and ``out``, where metrics.jsonl, curves.png and
    global_model.safetensors are left. ``echo`` gets one line per round (None: quiet)."""
    return run_sim(settings_of(settings, overrides), Path(out), broker_address=broker,
                   echo=echo or (lambda _line: None))  # fmt: skip


def write_federation(folder: str | Path, broker: str, settings: SimSettings | None = None,
                     **overrides: object) -> FederationLayout:  # fmt: skip
    """Write the keys, enrolment, partitioned data and configs of a server and ``agents`` agents under ``folder``
    (as ``skyfed sim`` does), for a broker at ``broker`` (``HOST:PORT``): the configs ``Server`` and ``Agent`` take.
    With ``mode="peer"`` the agents are peers (``sim.peer_federation``): no server, and ``server_config`` names
    no file; each peer's ``Agent`` ends once the peers elected their best model."""
    host, _, port = broker.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"broker must be HOST:PORT, got {broker!r}")
    chosen = settings_of(settings, overrides)
    write = create_peer_federation if chosen.mode == "peer" else create_federation
    return write(Path(folder).resolve(), chosen, (host, int(port)))


@contextmanager
def local_broker(folder: str | Path) -> Iterator[str]:
    """A loopback MQTT broker on a free port while the block runs, as ``skyfed sim`` starts one (mosquitto, else
    the pip-installed iotcore), its files in ``folder``; yields its ``HOST:PORT`` for ``write_federation``."""
    from sim.broker import start_broker

    broker = start_broker(data_dir=Path(folder))
    try:
        yield broker.address
    finally:
        broker.stop()


def read_metrics(path: str | Path) -> list[RoundMetrics]:
    """Every finished round: from a ``metrics.jsonl``, or a folder holding one (a server's ``state_dir``, a
    ``run_federation`` ``out``); none while no round has finished. A folder without one is a ``FileNotFoundError``."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
        if not path.exists() and not path.parent.joinpath("skyfed.lock").exists():
            raise FileNotFoundError(f"{path.parent}: no metrics.jsonl, and not a SkyFed state folder")
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such metrics file")
    try:
        return logged_rounds(path)
    except MessageError as exc:
        if PeerRoundMetrics.SCHEMA not in str(exc):
            raise
        raise ValueError(f"{path}: a peer-mode run's metrics, one line per round and peer: there is no server, so "
                         "no RoundMetrics; read them as SimResult.peer_rounds or one JSON object a line") from None


class _DaemonThread(ABC, Generic[C]):
    """A daemon built from its config file and run on a thread of this process until it ends or is stopped.
    The config is read, and refused with ``ConfigError``, in ``start``; the state folder is locked from
    ``start`` until the daemon has stopped."""

    role = ""

    def __init__(self, config: str | Path) -> None:
        self.config_path = Path(config)
        self.state_dir: Path | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @abstractmethod
    def _load(self) -> C:
        """The config, checked as the command checks it (``ConfigError`` naming the key)."""

    @abstractmethod
    def _build(self, config: C) -> Daemon:
        """The daemon, its state folder locked."""

    def start(self: D) -> D:
        from common.lock import StateDirInUse, release_state_dir

        if self._thread is not None:
            raise RuntimeError(f"this {self.role} was started already; make a new one")
        config = self._load()
        try:
            daemon = self._build(config)
        except StateDirInUse:  # another daemon's lock: not ours to release
            raise
        except BaseException:
            release_state_dir(config.state_dir)
            raise
        self.state_dir = config.state_dir
        self._thread = threading.Thread(target=self._run, args=(daemon,), name=f"skyfed-{self.role}", daemon=True)
        self._thread.start()
        return self

    def _run(self, daemon: Daemon) -> None:
        from common.lock import release_state_dir

        try:
            daemon.run(self._stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by wait() and stop()
            self._error = exc
        finally:
            release_state_dir(self.state_dir)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the daemon ends on its own (a server: after its rounds); False when ``timeout_s`` passed
        first. An error that ended it is raised here."""
        if self._thread is None:
            raise RuntimeError(f"this {self.role} was not started")
        self._thread.join(timeout_s)
        if self._error is not None:
            raise self._error
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop as on SIGTERM: the final retained status goes out, the connection closes, the lock is released."""
        self._stop.set()
        if self._thread is not None and not self.wait(timeout_s):
            raise TimeoutError(f"the {self.role} did not stop within {timeout_s:g} s")

    def __enter__(self: D) -> D:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Server(_DaemonThread["ServerConfig"]):
    """The aggregator of ``skyfed server run --config server.toml`` (a region's with ``[upstream]``). Ends after
    ``server.rounds`` unless ``keep_running``."""

    role = "server"

    def __init__(self, config: str | Path, *, keep_running: bool = False) -> None:
        super().__init__(config)
        self.keep_running = keep_running

    def _load(self) -> ServerConfig:
        from broker_server.cli import load_checked_server_config

        return load_checked_server_config(self.config_path)

    def _build(self, config: ServerConfig) -> Daemon:
        from broker_server.cli import build_server
        from region.cli import build_region

        return build_server(config, build_region, keep_running=self.keep_running, again_ok=False)

    def metrics(self) -> list[RoundMetrics]:
        """The rounds finished so far (``read_metrics`` on its state folder)."""
        if self.state_dir is None:
            raise RuntimeError("this server was not started")
        return read_metrics(self.state_dir)


class Agent(_DaemonThread["AgentConfig"]):
    """The agent of ``skyfed agent run --config agent.toml`` (a peer in peer mode); training runs in its
    training child process, as deployed. Runs until stopped: it waits for the server's next run (a peer ends
    after its federation's last round and election)."""

    role = "agent"

    def _load(self) -> AgentConfig:
        from agent.cli import load_checked_agent_config

        return load_checked_agent_config(self.config_path)

    def _build(self, config: AgentConfig) -> Daemon:
        from agent.cli import build_agent

        return build_agent(config, again_ok=False)
