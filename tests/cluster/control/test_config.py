"""Config validation: a typo names the field, keys never show in an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cluster.control.config import SloSection, TandemConfig


def test_local_config_loads(default_model_dir):
    config = TandemConfig.from_file(Path(__file__).parents[3] / "configs" / "local.yaml")
    assert config.engine_config().model == str(default_model_dir)


def test_config_typo_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  block_sise: 16\n")
    with pytest.raises(ValueError, match=r"engine\.block_sise"):
        TandemConfig.from_file(bad)
    bad.write_text("engine:\n  max_num_seqs: 0\n")
    with pytest.raises(ValueError, match=r"engine\.max_num_seqs"):
        TandemConfig.from_file(bad)


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


def test_the_readmes_autoscaler_block_is_a_valid_config():
    import re

    from tests.helpers.docs_pages import written_text

    readme = written_text()  # the blocks are on docs/guides/scaling.md
    load_block, slo_block = [b for b in re.findall(r"^```yaml\n(.*?)^```", readme, re.S | re.M) if "autoscaler:" in b]
    config = TandemConfig.model_validate(yaml.safe_load(load_block))
    assert config.autoscaler.mode == "load" and config.autoscaler == config.autoscaler.model_validate(
        {"mode": "load"})  # the block shows the shipped values
    slo = TandemConfig.model_validate(yaml.safe_load(slo_block)).autoscaler.slo
    shipped = SloSection(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, profile=slo.profile)
    assert slo == shipped  # the block shows the shipped values of what it does not have to set
    with pytest.raises(ValidationError, match="mode slo needs autoscaler.slo"):
        TandemConfig.model_validate({"autoscaler": {"mode": "slo"}})
    assert config.decode.min_replicas == 1 and config.decode.max_replicas == 8
    with pytest.raises(ValidationError, match="min_replicas above max_replicas"):
        TandemConfig.model_validate({"decode": {"min_replicas": 3, "max_replicas": 2}})
