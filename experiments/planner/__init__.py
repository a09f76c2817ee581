"""`tandem plan`: measure an engine profile on this hardware, and search pool ratios with the capacity
model (cluster/control/autoscale/profile.py: the profile format; experiments/capacity/: the simulator, metrics and the search).

Modules: measure / transfer_probe (measured profiles), workload (synthetic request lists), report + cli
(the command).
"""
