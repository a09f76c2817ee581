"""The scheduler actor (`actor.py`) and what it owns: registered workers and their liveness, requests in
flight and their committed KV, admission, placement and routing, the prefix index, tenant shares, its
zmq ports and outbox, and the loads it reports to the autoscaler."""
