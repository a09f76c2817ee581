"""Pools that size themselves: the scheduler's account of each pool's load (`pool_load.py`), the policy
that turns loads into pool sizes (`load_policy.py`: queue depth and KV thresholds, nothing to profile),
and the loop beside `tandem serve` that reads the loads every interval and resizes through the
drain-safe scaling path (`autoscaler.py`)."""
