"""Pools that size themselves, above the lifecycle they resize through: the policies that turn the loads the
scheduler reports (scheduler/pool_load.py, scheduler/demand.py) into pool sizes (`load_policy.py`: queue
depth and KV thresholds, nothing to profile; `slo_policy.py`: the TTFT and TPOT targets through the cost
model), the cost model they run on (`profile.py`: a step's cost from its shape, the JSON format `tandem plan
profile` writes; `fit.py` and `online_fit.py`: costs fitted from the steps workers log), and the loop beside
`tandem serve` that reads the loads every interval and resizes through the drain-safe scaling path
(`autoscaler.py`)."""
