"""The capacity simulator: what a layout of workers serves, predicted from an engine profile.

    from dataclasses import replace
    from cluster.control.config import TandemConfig
    from cluster.control.autoscale.profile import EngineLimits, EngineProfile
    from experiments.capacity.simulator import Layout, SimOptions, simulate
    from experiments.capacity.metrics import SLO, summarize
    from experiments.capacity.workload import SimRequest

    profile = EngineProfile.load("profile.json")          # `tandem plan profile --out profile.json`
    config = TandemConfig.from_file("configs/colocated.yaml")
    profile = replace(profile, engine=EngineLimits.from_config(config))
    requests = [SimRequest(arrival_s, prompt_len, output_len) for ...]
    result = simulate(profile, Layout.from_config(config), requests, SimOptions.from_config(config))
    s = summarize(result, SLO(ttft_s=1.0, tpot_s=0.1))
    s.goodput_rps, s.attainment, s.ttft.p90, s.tpot.p90, s.itl.p99

Modules: roofline (GPU profiles and model presets), workload (request lists), sim_worker + simulator (the
event loop), elastic (a run whose pools resize), metrics, search (pool ratios). The product keeps only the
cost model it runs on (cluster/control/autoscale/: profile, fit); `tandem plan` (experiments/planner/) and
`tandem bench autoscale` measure profiles and search layouts with these from above.
"""
