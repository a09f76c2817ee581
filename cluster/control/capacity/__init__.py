"""The performance model: what a layout of workers serves, predicted by simulation.

    from dataclasses import replace
    from cluster.control.config import TandemConfig
    from cluster.control.capacity.profile import EngineLimits, EngineProfile
    from cluster.control.capacity.simulator import Layout, SimOptions, simulate
    from cluster.control.capacity.metrics import SLO, summarize
    from cluster.control.capacity.workload import SimRequest

    profile = EngineProfile.load("profile.json")          # `tandem plan profile --out profile.json`
    config = TandemConfig.from_file("configs/colocated.yaml")
    profile = replace(profile, engine=EngineLimits.from_config(config))
    requests = [SimRequest(arrival_s, prompt_len, output_len) for ...]
    result = simulate(profile, Layout.from_config(config), requests, SimOptions.from_config(config))
    s = summarize(result, SLO(ttft_s=1.0, tpot_s=0.1))
    s.goodput_rps, s.attainment, s.ttft.p90, s.tpot.p90, s.itl.p99

Modules: profile (step cost model + JSON format), roofline (GPU profiles), workload (request lists),
sim_worker + simulator (the event loop), metrics, search (pool ratios). It lives in the product, not
with the measuring tools, because the cluster sizes its own pools from it; `tandem plan`
(experiments/planner/) measures profiles and searches layouts with it from above.
"""
