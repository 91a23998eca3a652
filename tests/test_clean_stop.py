"""A clean stop is clean while messages pour in: the broker never publishes the last will of a client
that stopped, so a final retained status ("finished", "offline" by choice) is not replaced by the will."""

import threading
import time

from protocol.mqtt import BrokerSettings, MqttClient, Will
from tests.fedharness import wait_until


def test_a_client_stopped_while_messages_arrive_leaves_its_final_status_not_its_will(broker):
    settings = BrokerSettings(host=broker.host, port=broker.port)
    watcher = MqttClient("watcher", settings, persistent=False)
    watcher.subscribe("t/status")
    flood = MqttClient("flood", settings, persistent=False)
    assert watcher.start(timeout_s=10) and flood.start(timeout_s=10)
    pouring = threading.Event()
    pouring.set()

    def pour() -> None:
        while pouring.is_set():
            flood.publish("t/busy", b"x" * 200, qos=0)
            time.sleep(0.0002)

    threading.Thread(target=pour, daemon=True).start()
    finals = []
    try:
        for i in range(5):
            client = MqttClient(f"stopper-{i}", settings, persistent=False, will=Will("t/status", b"will"))
            client.subscribe("t/busy", qos=0)
            assert client.start(timeout_s=10)
            time.sleep(0.3)  # shutting down, as a daemon does: its loop reads no more, the flood fills its inbox
            final = client.publish("t/status", f"final-{i}".encode(), retain=True)
            MqttClient.wait_published([final], 0.5)  # as a daemon's shutdown does: it may not come in time
            finals.append(f"final-{i}".encode())
            assert client.stop(5)
    finally:
        pouring.clear()
    seen = []

    def drained() -> bool:
        while (message := watcher.poll(0.05)) is not None:
            seen.append(message[1])
        return finals[-1] in seen

    wait_until(drained, 10, "the last final status")
    time.sleep(0.5)  # a will, had one been published after it, is on its way to the watcher now
    drained()
    watcher.stop()
    flood.stop()
    assert seen == finals  # no b"will" in between or after: each stop was a DISCONNECT the broker read
    closed = [line for line in broker.log_tail(200).splitlines() if "stopper-" in line and "disconnected." in line]
    assert len(closed) == 5, broker.log_tail(40)
