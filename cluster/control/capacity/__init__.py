"""The performance model the cluster runs on: `profile` (a step's cost from its shape, and the JSON format
`tandem plan profile` writes) and `fit` (costs fitted from the steps workers log). The autoscaler sizes
the pools with them. What predicts a whole layout from a profile (the simulator, its metrics and the
pool-ratio search) lives with the measuring tools, in experiments/capacity/.
"""
