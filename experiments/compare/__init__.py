"""`tandem bench compare`: one open-loop trace against colocated and disaggregated layouts of equal
resources, each started (`tandem serve` subprocess) and stopped here, with the planner's prediction.

    plan = ComparePlan(bench=BenchSpec(...), layouts=parse_layouts("2C,1P:1D"), base_config=..., model_path=...)
    data = run_compare(plan)        # JSON-shaped: spec, machine, runs[i].result (bench serve's run dict)

Modules: model (the ~100M compare model), layouts (layout syntax -> serve config), server (one serve
subprocess, stopped completely), run (the loop over layouts), predict (planner on the same trace),
rescore (goodput at 0.5x, 1x, 2x the SLOs),
machine (CPU count, load average), report (table, ratios), plots (PNGs), cli (argparse).
"""
