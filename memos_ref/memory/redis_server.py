"""Start and stop a throwaway ``redis-server`` on a free loopback port — for tests, notebook 12 and
``bench memory``. Nothing is persisted (no RDB, no AOF); the server is stopped by its PID.

To use an existing Redis instead, give :class:`~memos_ref.memory.redis_backend.RedisBackend` its URL.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from memos_ref.errors import BackendUnavailableError, ConfigError

__all__ = ["RedisServer", "redis_server_path"]


def redis_server_path() -> str | None:
    """Where ``redis-server`` is, or None (install it with ``apt-get install -y redis-server``)."""
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private ``redis-server`` process: ``with RedisServer() as server: RedisBackend(server.url)``.

    Args:
        port: the port (default: a free one).
        maxmemory: bytes, or None for no limit; with ``policy`` decides what Redis evicts when full.
        policy: Redis's ``maxmemory-policy`` (``allkeys-lfu`` is the closest to the hybrid score).
    """

    def __init__(self, port: int | None = None, *, maxmemory: int | None = None, policy: str = "allkeys-lfu") -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"port must be in 1-65535, got {port}")
        self.port = port or _free_port()
        self.maxmemory, self.policy = maxmemory, policy
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        exe = redis_server_path()
        if exe is None:
            raise BackendUnavailableError("redis-server is not on PATH: install it (apt-get install -y redis-server)")
        self._dir = tempfile.TemporaryDirectory(prefix="memos-redis-")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self._dir.name, "--maxmemory-policy", self.policy, "--loglevel", "warning"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory)]
        log = Path(self._dir.name) / "redis.log"
        args += ["--logfile", str(log)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                text = log.read_text(errors="replace") if log.exists() else ""
                self._cleanup()
                raise BackendUnavailableError(f"redis-server exited with {self.process.returncode}: {err}{text}")
            if self._pings():
                return self
            time.sleep(0.02)
        self.stop()
        raise BackendUnavailableError(f"redis-server on port {self.port} did not answer PING within {timeout} s")

    def _pings(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
