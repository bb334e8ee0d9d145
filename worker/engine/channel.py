"""One end of the socket pair between a worker and its engine process: whole pickled messages, each sent in
one piece however many threads send."""

from __future__ import annotations

import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any


class Channel:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple[Any, ...]:
        return pickle.loads(self.conn.recv_bytes())

    def close(self) -> None:
        with self._send_lock:
            self.conn.close()
