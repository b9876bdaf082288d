"""A network outage in front of a real server: a TCP port that forwards to it, or, while cut, drops every
connection it accepts (what a client sees while a server restarts). Tests point a client at ``url``."""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class Outage:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (host, port) until :meth:`cut`, again after :meth:`restore`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.refused = 0  # connections dropped while cut
        self._up = threading.Event()
        self._up.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, name="outage-accept", daemon=True).start()

    def cut(self) -> None:
        self._up.clear()

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> Outage:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._up.is_set():
                self.refused += 1
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
