"""The OpenAI Agents SDK's default model (it talks to `/v1/responses`) against `configs/default.yaml` as
shipped, SmolLM2-135M-Instruct: a run, a streamed run, a function tool forced and its result fed back
(the SDK resets tool_choice to "auto" for the next turn, which the shipped template and parser serve), a
run with a tool offered under "auto", and `output_type` with a Pydantic model all complete.

Greedy, on prompts this model answers and ends by itself: an answer cut by the server's default
`max_tokens` ends with `response.incomplete`, as OpenAI's does, and the SDK raises on it."""

from __future__ import annotations

import asyncio

import agents
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from cluster.control.config import TandemConfig
from tests.helpers.cluster import CONFIGS
from tests.helpers.http_server import serving

pytestmark = pytest.mark.slow  # the trained model behind a cluster

SERVED = "smollm2"
GREEDY = agents.ModelSettings(temperature=0)
RUN_S = 300


class City(BaseModel):
    city: str
    temperature: int


asked: list[str] = []


@agents.function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    asked.append(city)
    return f"sunny, 21 degrees in {city}"


@pytest.fixture(scope="module")
def server(ray_session, smollm2_dir):
    with serving(TandemConfig.from_file(CONFIGS / "default.yaml")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    agents.set_tracing_disabled(True)
    return server[1] + "/v1"


def run(url: str, agent_kwargs: dict, ask: str, stream: bool = False):
    async def go():
        # a client per event loop (each run has its own): the SDK's default model kind on it
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=RUN_S)
        model = agents.OpenAIResponsesModel(model=SERVED, openai_client=client)
        agent = agents.Agent(name="assistant", model=model, **{"model_settings": GREEDY, **agent_kwargs})
        if not stream:
            return await agents.Runner.run(agent, ask, max_turns=4)
        result = agents.Runner.run_streamed(agent, ask, max_turns=4)
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        return result, "".join(deltas)

    return asyncio.run(asyncio.wait_for(go(), RUN_S))


def kinds(result) -> list[str]:
    return [type(item).__name__ for item in result.new_items]


def test_a_run_and_a_streamed_run(client):
    whole = run(client, {"instructions": "Be brief."}, "What is the capital of France?")
    assert "Paris" in whole.final_output and kinds(whole) == ["MessageOutputItem"]
    streamed, deltas = run(client, {"instructions": "Be brief."}, "What is the capital of France?", stream=True)
    assert streamed.final_output == deltas == whole.final_output


def test_a_forced_tool_call_and_its_result_fed_back(client):
    asked.clear()
    result = run(client, {"tools": [get_weather], "model_settings": agents.ModelSettings(
        temperature=0, tool_choice="required")}, "What is the weather in Paris?")
    assert kinds(result) == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds(result)
    assert asked == ["Paris"] and result.final_output


def test_a_tool_under_auto(client):
    result = run(client, {"tools": [get_weather]}, "Hi!")
    assert result.final_output and "MessageOutputItem" in kinds(result)


def test_a_structured_output_type(client):
    result = run(client, {"output_type": City}, "What is the weather in Paris?")
    assert isinstance(result.final_output, City) and result.final_output.city
