"""First content chunk of a streamed chat answer with tools offered (tool_choice auto, the hermes parser)
against the same request without tools, on SmolLM2 through the HTTP server: the call reader holds back
only what could start a call, so the first content should come about as soon as without tools. Prints
the medians and their ratio; timings are this box's, not a test.

    python experiments/bench_tool_stream.py [--layout colocated.yaml] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import openai
import ray

from tests.helpers.cluster import load
from tests.helpers.http_server import serving

TEMPLATE = Path(__file__).resolve().parents[1] / "chat_templates" / "chatml-tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Write a short poem about the sea."}]


def first_content_s(client: openai.OpenAI, tools: list | None) -> tuple[float, float, str]:
    """(seconds to the first chunk with content, to the end, the answer)."""
    extra = {"tools": tools} if tools else {}
    started, first, text = time.perf_counter(), None, ""
    for chunk in client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, temperature=0,
                                                stream=True, **extra):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece and first is None:
            first = time.perf_counter() - started
        text += piece or ""
    return first if first is not None else float("nan"), time.perf_counter() - started, text


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--layout", default="colocated.yaml")
    args.add_argument("--runs", type=int, default=5)
    opts = args.parse_args()
    config = load(opts.layout)
    update = {"model": config.model.model_copy(update={"path": "builtin:smollm2"}),
              "ingress": config.ingress.model_copy(update={"chat_template": str(TEMPLATE), "tool_call_parser": "hermes"})}
    if config.colocated is not None:
        update["colocated"] = config.colocated.model_copy(update={"replicas": 1})
    ray.init(include_dashboard=False)
    with serving(config.model_copy(update=update)) as (_, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        first_content_s(client, None)  # warm-up: the first request compiles and caches what it can
        rows = {"without tools": [], "with tools": []}
        for _ in range(opts.runs):
            for name, tools in (("without tools", None), ("with tools", [WEATHER])):
                rows[name].append(first_content_s(client, tools))
    for name, runs in rows.items():
        print(f"{opts.layout} {name:14s} first content {statistics.median(r[0] for r in runs):.3f} s  "
              f"whole answer {statistics.median(r[1] for r in runs):.3f} s  answer {runs[0][2][:50]!r}")
    ratio = statistics.median(r[0] for r in rows["with tools"]) / statistics.median(r[0] for r in rows["without tools"])
    print(f"{opts.layout} first content with tools / without: {ratio:.2f}x")


if __name__ == "__main__":
    main()
