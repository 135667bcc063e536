"""The test suite's Redis Cluster: 3 masters + 3 replicas on free loopback ports (memos_ref.tiering.cluster_server),
formed once per run. In CI a missing redis-server is an error; elsewhere the cluster tests skip with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from memos_ref.tiering.cluster_server import ClusterServer, cluster_tools_path


def require_cluster_tools() -> None:
    if cluster_tools_path() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server/redis-cli are missing in CI: `make test` should have installed them")
        pytest.skip("redis-server is not installed here (apt-get install -y redis-server); `make test` installs it")


@contextmanager
def running_cluster(**kwargs: object) -> Iterator[ClusterServer]:
    """A started cluster, stopped (every process ended, its directory removed) on exit."""
    require_cluster_tools()
    cluster = ClusterServer(**kwargs).start(timeout=90)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()
