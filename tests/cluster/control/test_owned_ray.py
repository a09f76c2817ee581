"""A Ray that tandem starts for itself (`tandem serve` without --address) keeps its sessions (logs, the
raylet's and object store's sockets) where only its own user can reach them: Ray's default, /tmp/ray,
and each session directory in it are mode 0777."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray instance of its own, in a subprocess

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import os, stat
from ray._private import worker
from cluster.control.lifecycle.launch import Cluster
from tests.helpers.cluster import load
cluster = Cluster.start(load("local.yaml"))
try:
    path = worker._global_node.get_session_dir_path()
    parent = os.path.dirname(os.path.dirname(path))  # above Ray's temp directory, which Ray makes 0777
    print("TEMP", parent, oct(stat.S_IMODE(os.stat(parent).st_mode)), os.stat(parent).st_uid == os.getuid())
finally:
    cluster.shutdown()
"""


def test_a_ray_tandem_starts_keeps_its_session_directory_private():
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TEMP"))
    _, parent, mode, mine = line.split()
    assert parent != "/tmp/ray" and mode == "0o700" and mine == "True", line
