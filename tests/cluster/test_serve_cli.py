"""`tandem serve` as a user runs it: the README's main command (SmolLM2-135M-Instruct, 1 prefill + 1 decode
worker), driven by the official openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tandem_serve_answers_openai_and_stops_on_ctrl_c(smollm2_dir):
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(["tandem", "serve", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "tandem serve did not come up"
                time.sleep(0.5)
        assert [m.id for m in models] == ["smollm2"]
        out = client.completions.create(model="smollm2", prompt="Hello, tandem", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
        # A trained model: its greedy answer through the chat template (prefilled on one worker, decoded
        # on the other) is the right one.
        chat = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in chat.choices[0].message.content, chat.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    output = proc.stdout.read()
    assert rc == 0, output
    assert "shutting down" in output
