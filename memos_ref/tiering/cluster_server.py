"""Start and stop a throwaway Redis Cluster on loopback — for the tests, ``make cluster``, ``bench cluster`` and
notebook 08: ``masters`` masters with ``replicas`` replicas each, from Debian's ``redis-server`` and ``redis-cli``.

Each node runs in its own directory under one temporary directory, with nothing persisted (no RDB, no AOF) and a
short ``cluster-node-timeout`` (1 s by default), so a killed master's replica is promoted within a few seconds.
The cluster is formed with ``redis-cli --cluster create … --cluster-replicas N --cluster-yes`` and is ready when
every node answers ``cluster_state:ok`` and all 16384 slots are assigned. :meth:`ClusterServer.stop` ends every
process it started (by its PID: continued first if it was stopped with SIGSTOP) and removes the directory.

    python -m memos_ref.tiering.cluster_server        # a 3-master, 3-replica cluster until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from memos_ref.errors import BackendUnavailableError, ConfigError, check_index

__all__ = ["ClusterNode", "ClusterServer", "cluster_tools_path"]

_BUS_OFFSET = 10_000  # the cluster bus listens on port + 10000


def cluster_tools_path() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` paths, or None when either is missing (``apt-get install -y redis-server``)."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int, rng: random.Random) -> list[int]:
    """``n`` ports whose cluster-bus port (+10000) is free too, below the ephemeral range so the bus port fits."""
    ports: list[int] = []
    for _ in range(2000):
        if len(ports) == n:
            return ports
        p = rng.randrange(20_000, 30_000)
        if p not in ports and _free(p) and _free(p + _BUS_OFFSET):
            ports.append(p)
    raise BackendUnavailableError(f"found only {len(ports)} of {n} free loopback port pairs for a cluster")


@dataclass
class ClusterNode:
    """One ``redis-server`` of the cluster."""

    port: int
    process: subprocess.Popen
    stopped: bool = False  # SIGSTOPped by :meth:`ClusterServer.pause`

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class ClusterServer:
    """A private Redis Cluster: ``with ClusterServer() as c: ClusterTierBackend(c.url, fingerprint=...)``.

    Args:
        masters: master nodes. Three or more are formed with ``redis-cli --cluster create``; one or two (which it
            refuses) are given the slots with ``CLUSTER ADDSLOTSRANGE`` and joined with ``CLUSTER MEET``, without
            replicas (the 1-master baseline of ``bench cluster``).
        replicas: replicas per master.
        node_timeout_ms: ``cluster-node-timeout``: how long a silent master takes to be failed over.
        maxmemory: bytes per node, or None for no limit; with ``policy`` (``noeviction``: a full node answers OOM).
        seed: seeds the port choice (None: random).
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        *,
        node_timeout_ms: int = 1000,
        maxmemory: int | None = None,
        policy: str = "noeviction",
        seed: int | None = None,
    ) -> None:
        self.masters = check_index("masters", masters, lo=1, hi=64)
        self.replicas = check_index("replicas", replicas, lo=0, hi=4)
        if masters < 3 and replicas:
            raise ConfigError(f"a cluster of {masters} master(s) is formed without replicas; got replicas={replicas}")
        self.node_timeout_ms = check_index("node_timeout_ms", node_timeout_ms, lo=100, hi=600_000)
        if maxmemory is not None:
            check_index("maxmemory", maxmemory, lo=1 << 20)
        if not isinstance(policy, str) or not policy.replace("-", "").isalpha():
            raise ConfigError(f"policy must be a Redis maxmemory-policy name, got {policy!r}")
        self.maxmemory, self.policy = maxmemory, policy
        self._rng = random.Random(seed)
        self.nodes: list[ClusterNode] = []
        self._dir: tempfile.TemporaryDirectory | None = None

    # ------------------------------------------------------------------ addresses
    @property
    def url(self) -> str:
        """A startup URL (the first live, running node; the client discovers the rest)."""
        live = [n for n in self.nodes if n.alive and not n.stopped] or self.nodes
        return f"redis://{live[0].address}/0"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """Every node as ``(host, port)`` (give several, so a dead first node does not stop a client starting)."""
        return [("127.0.0.1", n.port) for n in self.nodes]

    @property
    def directory(self) -> str | None:
        """The temporary directory holding every node's files (None once stopped)."""
        return None if self._dir is None else self._dir.name

    def node(self, port: int) -> ClusterNode:
        for n in self.nodes:
            if n.port == port:
                return n
        raise ConfigError(f"no node of this cluster listens on port {port}")

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0) -> ClusterServer:
        """Start the nodes, form the cluster and wait (at most ``timeout`` s) for ``cluster_state:ok``."""
        tools = cluster_tools_path()
        if tools is None:
            raise BackendUnavailableError("redis-server or redis-cli is not on PATH: apt-get install -y redis-server")
        server, cli = tools
        deadline = time.monotonic() + timeout
        self._dir = tempfile.TemporaryDirectory(prefix="memos-cluster-")
        try:
            for port in _free_ports(self.masters * (1 + self.replicas), self._rng):
                self.nodes.append(ClusterNode(port, self._spawn(server, port)))
            for n in self.nodes:
                self._wait(lambda n=n: _ping(n.port), deadline, f"node {n.port} to answer PING", n)
            self._form(cli, deadline)
            self._wait(self.healthy, deadline, "cluster_state:ok on every node")
            self._wait(self.replicas_synced, deadline, "every replica to sync with its master")
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, cli: str, deadline: float) -> None:
        if self.masters >= 3:
            create = [cli, "--cluster", "create", *(n.address for n in self.nodes)]
            commands = [[*create, "--cluster-replicas", str(self.replicas), "--cluster-yes"]]
        else:  # redis-cli refuses fewer than 3 masters: split the slots by hand
            first, step = self.nodes[0].port, 16384 // self.masters
            commands = []
            for i, n in enumerate(self.nodes):
                hi = 16383 if i == self.masters - 1 else (i + 1) * step - 1
                commands.append([cli, "-p", str(n.port), "cluster", "addslotsrange", str(i * step), str(hi)])
                if n.port != first:
                    commands.append([cli, "-p", str(first), "cluster", "meet", "127.0.0.1", str(n.port)])
        for command in commands:
            left = max(1.0, deadline - time.monotonic())
            done = subprocess.run(command, capture_output=True, text=True, timeout=left, check=False)
            if done.returncode != 0 or "ERR" in done.stdout:
                raise BackendUnavailableError(f"{' '.join(command[1:4])} failed: {done.stdout[-800:]}{done.stderr}")

    def _spawn(self, server: str, port: int) -> subprocess.Popen:
        assert self._dir is not None
        home = Path(self._dir.name) / str(port)
        home.mkdir()
        args = [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
        args += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms)]
        args += ["--save", "", "--appendonly", "no", "--dir", str(home), "--logfile", str(home / "redis.log")]
        args += ["--maxmemory-policy", self.policy, "--loglevel", "warning"]
        # replicas sync at once and may always be promoted: a master killed right after start still fails over
        args += ["--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory)]
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait(self, ready, deadline: float, what: str, node: ClusterNode | None = None) -> None:
        while time.monotonic() < deadline:
            if node is not None and not node.alive:
                raise BackendUnavailableError(f"redis-server on port {node.port} exited: {self.log(node.port)[-800:]}")
            if ready():
                return
            time.sleep(0.05)
        raise BackendUnavailableError(f"timed out waiting for {what}")

    # ------------------------------------------------------------------ state
    def info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of one node as a dict (empty when it does not answer within 0.5 s)."""
        text = _command(port, "CLUSTER INFO")
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def healthy(self) -> bool:
        """Every live, running node says ``cluster_state:ok`` with all 16384 slots assigned."""
        live = [n for n in self.nodes if n.alive and not n.stopped]
        return bool(live) and all(
            (i := self.info(n.port)).get("cluster_state") == "ok" and i.get("cluster_slots_assigned") == "16384"
            for n in live
        )

    def replicas_synced(self) -> bool:
        """Every live replica's link to its master is up (``master_link_status:up``)."""
        for n in self.nodes:
            if n.alive and not n.stopped:
                text = _command(n.port, "INFO replication")
                if "role:slave" in text and "master_link_status:up" not in text:
                    return False
        return True

    def wait_healthy(self, timeout: float = 30.0) -> float:
        """Wait until :meth:`healthy`; returns the seconds waited (raises after ``timeout``)."""
        started = time.monotonic()
        self._wait(self.healthy, started + timeout, "cluster_state:ok")
        return time.monotonic() - started

    def roles(self) -> dict[int, str]:
        """Port -> ``master`` / ``slave`` as the live nodes see it now (from ``CLUSTER NODES``)."""
        for n in self.nodes:
            if n.alive and not n.stopped:
                text = _command(n.port, "CLUSTER NODES")
                if text:
                    out = {}
                    for line in text.splitlines():
                        parts = line.split()
                        if len(parts) > 2 and "fail" not in parts[2]:
                            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                            out[port] = "master" if "master" in parts[2] else "slave"
                    return out
        return {}

    def slots_served(self) -> dict[int, int]:
        """Port -> number of hash slots of each master that no node flags as failing (``fail`` or ``fail?``)."""
        for n in self.nodes:
            if n.alive and not n.stopped:
                text = _command(n.port, "CLUSTER NODES")
                if not text:
                    continue
                out = {}
                for line in text.splitlines():
                    parts = line.split()
                    if len(parts) > 7 and "master" in parts[2] and "fail" not in parts[2]:
                        ranges = [r.split("-") for r in parts[8:] if not r.startswith("[")]
                        port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                        out[port] = sum(int(r[-1]) - int(r[0]) + 1 for r in ranges)
                return out
        return {}

    def failed_over(self, port: int) -> bool:
        """Every slot is served by a master other than ``port`` and every live node says ``cluster_state:ok``."""
        served = self.slots_served()
        return port not in served and sum(served.values()) == 16384 and self.healthy()

    def master_ports(self) -> list[int]:
        return sorted(p for p, r in self.roles().items() if r == "master")

    def log(self, port: int) -> str:
        if self._dir is None:
            return ""
        path = Path(self._dir.name) / str(port) / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ------------------------------------------------------------------ faults
    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: its replica is promoted after the node timeout)."""
        n = self.node(port)
        if n.alive:
            n.process.kill()
            n.process.wait(10)

    def pause(self, port: int) -> None:
        """SIGSTOP one node (hung: it accepts connections but never answers)."""
        n = self.node(port)
        n.process.send_signal(signal.SIGSTOP)
        n.stopped = True

    def resume(self, port: int) -> None:
        """SIGCONT a paused node."""
        n = self.node(port)
        n.process.send_signal(signal.SIGCONT)
        n.stopped = False

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """End every node this object started (continued first when paused) and remove the directory."""
        for n in self.nodes:
            if n.alive:
                with contextlib.suppress(ProcessLookupError):
                    n.process.send_signal(signal.SIGCONT)
                n.process.terminate()
        for n in self.nodes:
            try:
                n.process.wait(5)
            except subprocess.TimeoutExpired:
                n.process.kill()
                n.process.wait()
        self.nodes = []
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> ClusterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(port: int, command: str, timeout: float = 0.5) -> str:
    """One inline command's bulk reply as text ('' on any failure); enough for CLUSTER INFO / NODES."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(command.encode() + b"\r\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                head, _, body = data.partition(b"\r\n")
                if head.startswith(b"$") and len(body) >= int(head[1:]):
                    return body[: int(head[1:])].decode(errors="replace")
                if head.startswith((b"-", b"+")):
                    return ""
                if len(data) > 1 << 20:
                    return ""
    except (OSError, ValueError):
        return ""
    return ""


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m memos_ref.tiering.cluster_server``: start a cluster, print its nodes, run until Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args(argv)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the cluster as Ctrl-C does: no server is left behind

    signal.signal(signal.SIGTERM, interrupt)
    with ClusterServer(args.masters, args.replicas) as cluster:
        print(f"Redis Cluster ready (pid {os.getpid()}): {' '.join(n.address for n in cluster.nodes)}")
        print(f"  ClusterTierBackend({cluster.url!r}, fingerprint=...)   Ctrl-C stops it and removes its files")
        with contextlib.suppress(KeyboardInterrupt):
            while all(n.alive for n in cluster.nodes):
                time.sleep(1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
