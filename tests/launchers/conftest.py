"""The two-node Ray cluster fixture (see ``cluster.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl.procs import free_port
from tests.launchers.cluster import HEAD, Cluster, cluster_pids, start_cluster, stop_cluster


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """Head 127.0.0.2 (resource ``engine``) and worker 127.0.0.3 (resource ``trainer``)."""
    pytest.importorskip("ray", reason="Ray (asyncrl[ray]) is not installed")
    cluster, procs = start_cluster(free_port(HEAD))
    try:
        yield cluster
    finally:
        stop_cluster(procs, cluster.temp_dir)
        assert not cluster_pids(cluster.temp_dir), "a Ray process outlived the cluster"
