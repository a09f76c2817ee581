"""`tandem generate` as a user runs it, and config validation."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tandem", *args], capture_output=True, text=True, timeout=120)


def test_generate_json_matches_the_engine(default_model_dir):
    proc = _tandem("generate", "--model", "builtin:tiny-llama", "--prompt", "Hello, tandem", "--max-tokens", "12",
                   "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    engine = Engine(TandemConfig().engine_config())
    (ref,) = engine.generate(["Hello, tandem"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out["token_ids"] == ref.outputs[0].token_ids
    assert out["text"] == engine.tokenizer.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
    assert out["finish_reason"] == "length"


def test_generate_seeded_sampling_is_reproducible(default_model_dir):
    args = ("generate", "--model", "builtin:tiny-llama", "--prompt", "seeded", "--max-tokens", "10", "--temperature",
            "0.8", "--seed", "5", "--json")
    first, second = _tandem(*args), _tandem(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


def test_generate_bad_input_is_a_clear_error():
    proc = _tandem("generate", "--prompt", "x", "--top-p", "0")
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr


def test_config_typo_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  block_sise: 16\n")
    with pytest.raises(ValueError, match=r"engine\.block_sise"):
        TandemConfig.from_file(bad)
    bad.write_text("engine:\n  max_num_seqs: 0\n")
    with pytest.raises(ValueError, match=r"engine\.max_num_seqs"):
        TandemConfig.from_file(bad)


def test_local_config_loads(default_model_dir):
    config = TandemConfig.from_file(Path(__file__).parents[2] / "configs" / "local.yaml")
    assert config.engine_config().model == str(default_model_dir)


def test_serve_refuses_a_routable_ingress_without_keys(tmp_path):
    """Before anything starts: no Ray, no workers (it returns at once)."""
    proc = _tandem("serve", "--host", "0.0.0.0", "--port", "18099")
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0 with no API keys" in proc.stderr and "Traceback" not in proc.stderr


def test_keys_in_a_config_error_are_redacted(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ingress:\n  api_keys:\n    sk-live-0123456789: {tenant: 5, extra: 1}\n")
    with pytest.raises(ValueError) as err:
        TandemConfig.from_file(bad)
    assert "ingress.api_keys.<key>.tenant" in str(err.value) and "sk-live" not in str(err.value)
    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-file-0123456789: {tenant: 5}\n")
    bad.write_text(f"ingress:\n  api_keys_file: {keys}\n")
    with pytest.raises(ValueError) as err:
        TandemConfig.from_file(bad).ingress.tenants()
    assert "tenant" in str(err.value) and "sk-file" not in str(err.value)
    keys.write_text("sk-file-0123456789: {tenant: team-a}\n")
    assert TandemConfig.from_file(bad).ingress.tenants()["sk-file-0123456789"].tenant == "team-a"
