"""The listening socket, bound before anything heavy is imported or built.

``llmrt serve`` binds it first, so clients connect at once (their requests wait in the
backlog, then get 503 from ``/health`` and the API until the model is warm) and a port in
use or a bad host is one clear error line before seconds of start-up. Imports nothing
beyond the standard library and :mod:`llmrt.errors`.
"""

from __future__ import annotations

import errno
import socket

from llmrt.errors import LLMRTError


class ListenError(LLMRTError, OSError):
    """The server cannot listen on the address asked for (port in use, bad host)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    if not 0 <= port <= 65535:
        raise ListenError(f"--port {port}: must be in [0, 65535]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            reason = "the address is already in use (another server? pick another --port)"
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = "no interface of this machine has that address (check --host)"
        elif exc.errno == errno.EACCES:
            reason = "permission denied (ports below 1024 need privileges)"
        else:
            reason = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {shown}: {reason}") from None
    except BaseException:
        sock.close()
        raise
    return sock


class StartingResponder:
    """Answers every connection on the bound socket with 503 "starting" while the process
    is still importing and building the server (owns a thread; borrows the socket).

    Without it a client that connects during those seconds waits in the listen backlog
    with no answer; with it, it gets what ``/health`` says until the server runs. ``stop``
    (idempotent) hands the socket over: call it just before the server starts accepting.
    """

    #: What ``/health`` says and, for OpenAI clients, the API's own error shape.
    _BODY = (
        b'{"status": "starting", "error": {"message": "the model is still loading", '
        b'"type": "service_unavailable", "param": null, "code": null}}'
    )
    _REPLY = (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"Content-Type: application/json\r\n"
        b"Retry-After: 1\r\n"
        b"Connection: close\r\n"
        b"Content-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
    )

    def __init__(self, sock: socket.socket) -> None:
        import threading

        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmrt-starting", daemon=True)

    def start(self) -> StartingResponder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import select

        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.05)
                if not ready or self._stop.is_set():
                    continue
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # the socket was closed: nothing left to answer
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.recv(65536)  # the request line and headers, unread beyond that
                    conn.sendall(self._REPLY)
                except OSError:
                    pass
