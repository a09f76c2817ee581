"""Finding 6 of issue 52: with no admin key configured, a loopback ingress answered every local user's
admin calls (uid 1001 ran `POST /admin/scale {"decode": 2}`, 200 and a worker added, and read
`/admin/steps`), and a key sent without `Bearer ` was taken. Now the ingress generates a key at start in
a 0600 file of a 0700 directory (cluster/frontend/admin_key.py): another user gets 401 and cannot read the
file; this user's `tandem scale` finds the key there."""

from __future__ import annotations

import argparse
import os
import stat

import httpx
import pytest

from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.admin_key import generated_key_path, read_generated_key
from cluster.frontend.http.server import make_server
from tests.helpers.cluster import load
from tests.helpers.http_server import running
from tests.helpers.other_user import as_other, other_user


@pytest.fixture(scope="module")
def served(ray_session):
    cluster = Cluster.start(load("local.yaml"))
    assert cluster.config.ingress.admin_key is None and cluster.config.ingress.admin_key_file is None
    try:
        with running(make_server(cluster, "127.0.0.1", 0)) as url:
            yield cluster, url
    finally:
        cluster.shutdown()


def test_another_user_gets_401_and_cannot_read_the_key(served):
    cluster, url = served
    other_user()
    # decode 1000: past max_replicas, so the old code's answer (it let the call through) was a 400, not a resize.
    scale = as_other(f"curl -s -o /dev/null -w '%{{http_code}}' -X POST -H 'Content-Type: application/json' "
                     f"-d '{{\"decode\": 1000}}' {url}/admin/scale")
    steps = as_other(f"curl -s -o /dev/null -w '%{{http_code}}' {url}/admin/steps")
    assert (scale.stdout, steps.stdout) == ("401", "401"), (scale, steps)
    path = generated_key_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.geteuid()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.stat().st_uid == os.geteuid()
    # Not even with the home directory opened up: the key's own directory and file stop the other user.
    above = (path.parent.parent.parent, path.parent.parent)  # the home directory and ~/.cache
    modes = [stat.S_IMODE(d.stat().st_mode) for d in above]
    try:
        for directory, mode in zip(above, modes):
            directory.chmod(mode | 0o005)
        read = as_other(f"cat {path}")
        listed = as_other(f"ls {path.parent}")
    finally:
        for directory, mode in zip(above, modes):
            directory.chmod(mode)
    assert read.returncode != 0 and "Permission denied" in read.stderr and read.stdout == "", read
    assert listed.returncode != 0, listed
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]
    cluster.check_integrity()


def test_the_generated_key_works_only_as_a_bearer_token(served):
    cluster, url = served
    key = read_generated_key()
    assert key and len(key) >= 40
    assert httpx.get(url + "/admin/steps", timeout=30).status_code == 401
    assert httpx.get(url + "/admin/steps", headers={"Authorization": key}, timeout=30).status_code == 401
    assert httpx.get(url + "/admin/steps", headers={"Authorization": f"Basic {key}"}, timeout=30).status_code == 401
    ok = httpx.get(url + "/admin/steps", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["workers"]) == 2


def test_tandem_scale_reads_the_generated_key(served, capsys, monkeypatch):
    """The command's own code (in this process: a `tandem` subprocess would import another checkout)."""
    from tandem.scale import run

    cluster, url = served
    monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
    args = argparse.Namespace(prefill=None, decode=1, colocated=None, url=url, admin_key_file=None, timeout=120.0)
    assert run(args) == 0
    assert "decode x1" in capsys.readouterr().out
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]
