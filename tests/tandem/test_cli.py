"""The `tandem` command line as a user runs it: lazy commands, a missing extra named, `tandem generate`."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_serve_refuses_a_routable_ingress_without_keys(tmp_path):
    """Before anything starts: no Ray, no workers (it returns at once)."""
    proc = _tandem("serve", "--host", "0.0.0.0", "--port", "18099")
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0 with no API keys" in proc.stderr and "Traceback" not in proc.stderr


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_loads_only_the_named_command():
    """`tandem --help` imports no command; `serve --help` no measuring tool and none of the bench extra."""
    proc = _python(
        "import contextlib, io, sys\n"
        "from tandem.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['scale', '--help'], ['bench', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "    print(argv[0], sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "                          ('experiments', 'openai', 'matplotlib', 'cluster', 'actors')))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["--help []", "serve []", "scale []", "bench []"]


def test_every_command_has_help(capsys):
    from tandem.cli import BENCH, PRODUCT, main

    for argv in [[name] for name in PRODUCT] + [["bench", name] for name in BENCH] + [["plan"], ["plan", "profile"]]:
        with pytest.raises(SystemExit) as stopped:
            main([*argv, "--help"])
        assert stopped.value.code == 0 and capsys.readouterr().out.startswith(f"usage: tandem {' '.join(argv)} "), argv


def test_a_missing_extra_is_named(tmp_path):
    """Without the bench extra's openai, `tandem bench chaos` says what to install and exits 2."""
    proc = _python("import sys\n"
                   "sys.modules['openai'] = None  # as if not installed: importing it raises ModuleNotFoundError\n"
                   "from tandem.cli import main\n"
                   f"sys.exit(main(['bench', 'chaos', '--out', {str(tmp_path / 'chaos.json')!r}]))\n")
    assert proc.returncode == 2, proc.stderr
    assert "needs the optional package 'openai'" in proc.stderr and "pip install -e '.[bench]'" in proc.stderr
    assert "Traceback" not in proc.stderr
