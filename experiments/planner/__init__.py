"""`tandem plan`: predict goodput of a cluster layout by simulation, and search pool ratios.

    from dataclasses import replace
    from cluster.control.config import TandemConfig
    from experiments.planner.profile import EngineLimits, EngineProfile
    from experiments.planner.simulator import Layout, SimOptions, simulate
    from experiments.planner.metrics import SLO, summarize
    from experiments.planner.workload import SimRequest

    profile = EngineProfile.load("profile.json")          # `tandem plan profile --out profile.json`
    config = TandemConfig.from_file("configs/colocated.yaml")
    profile = replace(profile, engine=EngineLimits.from_config(config))
    requests = [SimRequest(arrival_s, prompt_len, output_len) for ...]
    result = simulate(profile, Layout.from_config(config), requests, SimOptions.from_config(config))
    s = summarize(result, SLO(ttft_s=1.0, tpot_s=0.1))
    s.goodput_rps, s.attainment, s.ttft.p90, s.tpot.p90, s.itl.p99

Modules: profile (cost model + JSON format), measure / transfer_probe (measured profiles), roofline
(GPU profiles), workload (request lists), sim_worker + simulator (the event loop), metrics, search
(pool ratios), report + cli (the command).
"""
