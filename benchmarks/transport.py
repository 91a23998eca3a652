"""One 12.8 MB update from agent to server over loopback mosquitto: sealed vs plain chunks, same run.

Sealed: ``seal`` to the server's key, publish the ~1 MiB chunks at QoS 1, and on the receiving side
``Reassembler.feed`` (signature, AEAD, bounds, whole-transfer SHA-256) until the transfer completes.
Plain: the same bytes cut into the same chunk size, published at QoS 1 and joined by the receiver.
Both use the same two paho clients, interleaved, so broker and machine noise hit both alike.
Target: sealed <= 1.5x plain (median).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import report
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.transfer import Reassembler
from security.envelope import Opener, seal
from security.keys import Identity, Keyring
from sim.broker import start_broker

SIZE = 12_800_000
CHUNK = 1 << 20


def plain_chunk(data: bytes, index: int) -> bytearray:
    """A 4-byte index and the chunk's bytes, written once into a fresh buffer (as ``seal`` does)."""
    piece = memoryview(data)[index * CHUNK : (index + 1) * CHUNK]
    out = bytearray(4 + len(piece))
    out[:4] = index.to_bytes(4, "big")
    out[4:] = piece
    return out


class Receiver:
    """Collects chunks on one topic until a whole transfer is there, then sets ``done``."""

    def __init__(self, client: MqttClient, reassembler: Reassembler) -> None:
        self.client, self.reassembler = client, reassembler
        self.done = threading.Event()
        self.expect_plain = 0
        self.plain: bytearray | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        got = 0
        while not self._stop.is_set():
            message = self.client.poll(0.05)
            if message is None:
                continue
            topic, payload = message
            if topic.endswith("/plain"):
                index = int.from_bytes(payload[:4], "big")
                assert self.plain is not None
                self.plain[index * CHUNK : index * CHUNK + len(payload) - 4] = memoryview(payload)[4:]
                got += 1
                if got == self.expect_plain:
                    got = 0
                    self.done.set()
            elif self.reassembler.feed(payload, topic_sender="agent", kinds=frozenset({"update"})) is not None:
                self.done.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def main(repeats: int = 9) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, start_broker(data_dir=Path(tmp) / "broker") as broker:
        server, agent = Identity.generate("server"), Identity.generate("agent")
        keyring = Keyring()
        keyring.add(agent.public)
        reassembler = Reassembler(Opener(identity=server, federation="bench", senders=keyring))
        settings = BrokerSettings(host=broker.host, port=broker.port)
        rx = MqttClient("bench-rx", settings, persistent=False)
        tx = MqttClient("bench-tx", settings, persistent=False)
        rx.subscribe("bench/#")
        rx.start(10), tx.start(10)
        receiver = Receiver(rx, reassembler)
        data = os.urandom(SIZE)

        def sealed() -> float:
            receiver.done.clear()
            started = time.perf_counter()
            _, chunks = seal(data, sender=agent, federation="bench", kind="update", round=1, recipient=server.public)
            tx.publish_all(("bench/sealed", c) for c in chunks)
            receiver.done.wait(30)
            return time.perf_counter() - started

        def plain() -> float:
            receiver.done.clear()
            receiver.plain = bytearray(SIZE)
            receiver.expect_plain = -(-SIZE // CHUNK)
            started = time.perf_counter()
            tx.publish_all(("bench/plain", plain_chunk(data, i)) for i in range(receiver.expect_plain))
            receiver.done.wait(30)
            assert bytes(receiver.plain) == data
            return time.perf_counter() - started

        sealed(), plain()  # warm-up
        sealed_s, plain_s = [], []
        for _ in range(repeats):
            sealed_s.append(sealed())
            plain_s.append(plain())
        receiver.close()
        rx.stop(), tx.stop()
    s, p = statistics.median(sealed_s), statistics.median(plain_s)
    return [
        report(
            "sealed_update_12.8MB",
            target="sealed <= 1.5x plain chunked transfer",
            ok=s / p <= 1.5,
            sealed_ms=round(s * 1e3, 1),
            plain_ms=round(p * 1e3, 1),
            ratio=round(s / p, 2),
            broker=broker.kind,
        )
    ]


if __name__ == "__main__":
    main()
