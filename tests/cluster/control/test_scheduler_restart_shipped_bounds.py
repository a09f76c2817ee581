"""The scheduler and a decode worker die together, with the heartbeat timeout and lease as shipped.

Its own module: a tandem cluster is one per Ray cluster, and test_scheduler_restart's module cluster
runs on shortened bounds."""

from __future__ import annotations

import pytest

from cluster.control.config import SchedulerSection
from cluster.control.lifecycle.launch import Cluster
from tests.cluster.control.test_scheduler_restart import config, lose_the_scheduler_and_a_decode_worker  # noqa: F401

pytestmark = pytest.mark.slow  # two kills at the shipped bounds


def test_streams_lost_with_the_scheduler_and_their_worker_are_migrated_at_the_shipped_bounds(ray_session, config):
    """The restarted scheduler settles only after twice the shipped heartbeat timeout; the client's
    audit must still find the lost streams and migrate them to the fault-free output."""
    shipped = SchedulerSection()
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={
        "heartbeat_timeout_s": shipped.heartbeat_timeout_s, "lease_s": shipped.lease_s})})
    cluster = Cluster.start(config)
    try:
        # 32 s idle, 39 s beside a CPU hog (20 s of it the restarted scheduler settling): the streams get
        # the client's default deadline, 120 s.
        lose_the_scheduler_and_a_decode_worker(cluster, config, timeout_s=120)
    finally:
        cluster.shutdown()
