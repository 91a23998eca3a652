"""A real TCP relay between one client and the broker, whose downlink a test can hold (a congested link).

While held, the broker's bytes for the client are dropped instead of passed on: what a link holding
them in flight loses when the broker dies before they get through (tests hold, then kill the broker).
When either side closes, the relay closes the other, so the client sees the disconnect and reconnects.
"""

from __future__ import annotations

import socket
import threading


class LinkProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.holding = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="link-proxy", daemon=True).start()

    def hold(self) -> None:
        self.holding.set()

    def release(self) -> None:
        self.holding.clear()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:  # the broker is down: the client sees the connection refused-and-closed
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, downlink: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if not (downlink and self.holding.is_set()):
                    sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()
