"""Re-run the planner on a committed compare.json (its exact traces and layouts) with another profile.

Usage: python experiments/compare/repredict.py PROFILE.json COMPARE.json
"""
import json
import sys

from cluster.control.config import TandemConfig
from experiments.compare.predict import predict, validation
from cluster.control.autoscale.profile import EngineProfile

prof = EngineProfile.load(sys.argv[1])
d = json.load(open(sys.argv[2]))
for entry in d["runs"]:
    cfg = TandemConfig.model_validate(entry["config"])
    run = entry["result"]
    v = validation(predict(prof, cfg, run), run)
    print(entry["layout"], {k: (round(x["predicted"],3), round(x["measured"],3), None if x["relative_error"] is None else f'{x["relative_error"]:+.1%}') for k, x in v.items()})
