"""Bounded monitoring endpoints: idle clients and a full descriptor table never hold up a daemon's rounds."""

import resource
import selectors
import socket
import subprocess
import sys
import time

import pytest

from protocol.bounded_http import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from sim.broker import free_port
from tests.fedharness import Federation, override_toml, wait_until
from tests.liveharness import ROOT, scrape

IDLE_CONNECTIONS = 1_100


def idle_connections(port: int, count: int, *, in_flight: int = 32, within_s: float = 60.0) -> list[socket.socket]:
    """Up to ``count`` TCP connections to ``port`` that never send a byte, at most ``in_flight`` handshakes
    at a time (idle clients piling up, not a burst beyond the listen queue); whatever is not connected
    within ``within_s`` (a server that no longer accepts) is closed and left out."""
    selector, opened, started = selectors.DefaultSelector(), [], 0
    deadline = time.monotonic() + within_s
    while len(opened) < count and time.monotonic() < deadline:
        while started < count and len(selector.get_map()) < in_flight:
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            selector.register(s, selectors.EVENT_WRITE)
            started += 1
        for key, _ in selector.select(0.5):
            selector.unregister(key.fileobj)
            if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                opened.append(key.fileobj)
            else:
                key.fileobj.close()
                started -= 1  # refused (the listen queue was full): tried again
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()
    return opened


def closed_by_server(sockets: list[socket.socket]) -> int:
    closed = 0
    for s in sockets:
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionResetError:
            closed += 1
    return closed


@pytest.fixture
def descriptors_for_idle_connections():
    """This process opens the idle connections: room for them in its own table (a CI runner may give 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = IDLE_CONNECTIONS + 1_024
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the descriptor hard limit {hard} leaves no room for {IDLE_CONNECTIONS} idle connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def systemd_default_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1_024, 1_024))  # a unit without LimitNOFILE: a soft limit of 1,024


@pytest.mark.timeout(300)
def test_1100_idle_connections_to_the_metrics_port_leave_the_rounds_of_a_1024_descriptor_server_unchanged(
    tmp_path, broker, descriptors_for_idle_connections
):
    """prometheus-client's server gave each of them a thread and a descriptor for ever: the server's table
    filled, ``Too many open files`` stalled its rounds. Now only ``MAX_CONNECTIONS`` are held, until idle."""
    port = free_port()

    def edit(layout):  # noqa: ANN001
        override_toml(layout.server_config, metrics={"prometheus_port": port}, rounds={"quorum": 2})

    fed = Federation(tmp_path, broker, rounds=1_000, agents=2, edit=edit)  # stopped once the test has seen enough:
    # its last scrape comes 10 s (the idle timeout) after five rounds, which 50 rounds of 0.2 s no longer outlast
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "skyfed", "server", "run", "--config",
                                   str(fed.layout.server_config)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  preexec_fn=systemd_default_descriptor_limit)  # fmt: skip
    fed.start_agents()
    idle: list[socket.socket] = []
    try:
        wait_until(lambda: len(fed.metrics()) >= 3, 120, "three rounds before the idle connections")
        idle = idle_connections(port, IDLE_CONNECTIONS)
        opened_in = len(fed.metrics()) + 1  # the round open while they were made
        assert len(idle) == IDLE_CONNECTIONS, "the server stopped accepting connections"
        beyond_cap = IDLE_CONNECTIONS - MAX_CONNECTIONS
        wait_until(lambda: closed_by_server(idle) >= beyond_cap, 10, "the connections beyond the cap closed at once")
        wait_until(lambda: len(fed.metrics()) >= opened_in + 2, 120, "two rounds beside the idle connections")
        beside = len(fed.metrics())
        wait_until(lambda: closed_by_server(idle) == len(idle), IDLE_TIMEOUT_S + 10, "the idle ones to time out")
        assert scrape(port)[("skyfed_server_round", ())] >= beside  # a fresh scrape is answered
    finally:
        for s in idle:
            s.close()
        server.terminate()
        server.wait(30)
        fed.close()
    durations = [m.duration_s for m in fed.metrics()]
    before, during = durations[1:3], durations[opened_in:beside]  # round 1 includes the agents' start-up
    assert max(during) < 3 * max(before) + 5, durations
    text = log.read_text()
    assert "Too many open files" not in text and "Traceback" not in text
    assert text.count("connections open: closed a new one") == 1  # over a thousand refusals, one log line


FULL_TABLE = """
import resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from protocol.bounded_http import BoundedWSGIServer
server = BoundedWSGIServer(("127.0.0.1", 0), lambda environ, start_response: [])
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(0.5)  # serve_forever holds its selector before the table fills
hog = []
try:
    while True:
        hog.append(open("/dev/null"))
except OSError:
    pass
print(server.server_address[1], flush=True)  # only now: a connection made earlier would be accepted
sys.stdin.readline()
cpu = time.process_time()
time.sleep(2)
print(time.process_time() - cpu, flush=True)
"""


def test_a_full_descriptor_table_pauses_the_metrics_accept_loop_instead_of_spinning_it():
    """A connection waits to be accepted and ``accept`` fails (EMFILE): the listening socket stays readable,
    and socketserver's loop retried at once, burning a core (0.57 s of CPU in 2 s on the busy test VM) and
    the GIL the daemon's own loop needs."""
    child = subprocess.Popen([sys.executable, "-c", FULL_TABLE], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            child.stdin.write("the table is full\n")
            child.stdin.flush()
            cpu_s = float(child.stdout.readline())
    finally:
        child.kill()
        _, stderr = child.communicate(timeout=10)
    assert cpu_s < 0.2
    assert "metrics endpoint cannot accept a connection: Too many open files" in stderr
