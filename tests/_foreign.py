"""A Unix socket server that is no cupy_ipcpool peer: it answers in another protocol."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

HTTP = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<!DOCTYPE html>"


@contextlib.contextmanager
def foreign_server(path: str, kind: int, answer: bytes = HTTP) -> Iterator[list[bytes]]:
    """A server at ``path`` that reads what it is sent and answers ``answer``; yields what
    it read from each connection."""
    listener = socket.socket(socket.AF_UNIX, kind)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(0.1)
    stop = threading.Event()
    heard: list[bytes] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    heard.append(conn.recv(1 << 16))
                    conn.send(answer)
                stop.wait(0.5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield heard
    finally:
        stop.set()
        thread.join(5)
        listener.close()
