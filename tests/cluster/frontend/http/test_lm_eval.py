"""lm-eval's `local-completions` against a live 1P+1D cluster on a multiple-choice task built here (no
download): every choice's loglikelihood equals what lm-eval's own transformers backend (`hf`) computes on
the same model (within 1e-3), on the first run and on a second one whose contexts are all in the prefix
cache. lm-eval tokenizes through the server (`/tokenizer_info`, `/tokenize`), as it does against vLLM."""

from __future__ import annotations

import json

import pytest

from actors.engine.engine import Engine
from tests.helpers.cluster import load
from tests.helpers.http_server import MODEL

pytestmark = pytest.mark.slow  # lm-eval against the trained model

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mars", " Venus", " Earth"], 0),
    ("A week has seven", [" days", " hours", " months"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud", " tall"], 0),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_task")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "tandem_mc.yaml").write_text(f"""task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return str(root)


def _loglikelihoods(task_dir: str, model: str, model_args: str) -> dict[int, list[float]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tandem_mc"],
                                  task_manager=TaskManager(include_path=task_dir), log_samples=True,
                                  batch_size=1)
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"]["tandem_mc"]}


def test_local_completions_loglikelihoods_equal_transformers(server, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = Engine(load("local.yaml").engine_config()).config.model
    # The same token ids both ways: lm-eval's remote tokenizer adds no BOS, its hf backend would by default.
    want = _loglikelihoods(task_dir, "hf", f"pretrained={model_dir},dtype=float32,device=cpu,add_bos_token=False")
    args = f"model={MODEL},base_url={server[1]}/v1/completions,num_concurrent=1,max_retries=1,tokenizer_backend=auto"
    cold = _loglikelihoods(task_dir, "local-completions", args)
    cached = _loglikelihoods(task_dir, "local-completions", args)  # every context is in the prefix cache now
    assert sorted(want) == sorted(cold) == list(range(len(QUESTIONS)))
    for doc in want:
        assert cold[doc] == pytest.approx(want[doc], abs=1e-3), doc
        assert cached[doc] == pytest.approx(want[doc], abs=1e-3), doc
