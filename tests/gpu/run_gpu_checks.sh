#!/usr/bin/env bash
# The GPU checks (tests/gpu/test_gpu.py) in one call, on a machine with one CUDA GPU, then the report.
#
#   tests/gpu/run_gpu_checks.sh            # report: ./gpu-report.json (TANDEM_GPU_REPORT overrides)
#
# It uses the machine's own CUDA build of torch and never installs torch: tandem pins a CPU build,
# so `pip install -e .` would replace it. tandem itself runs from this checkout (PYTHONPATH). Other
# modules the checks import and the machine lacks come from wheels in .whl/ (offline machines), or
# else from PyPI, into a private folder. TANDEM_GPU_TIMEOUT_S bounds the test run (default 420).
# An offline machine with Python 3.12 and no pyzmq or msgspec (the lent H200's image): fetch their wheels
# into .whl/ beforehand with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pyzmq msgspec`.
# The Triton attention path and the fused kernels need only the triton of the machine's CUDA torch;
# FlashInfer's path runs only where flashinfer-python is installed (its wheel is ~100 MB).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
REPORT=${TANDEM_GPU_REPORT:-$PWD/gpu-report.json}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
if ! $PY -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(not torch.cuda.is_available())'; then
    echo "run_gpu_checks: this python's torch sees no CUDA GPU; the checks would only skip" >&2
    exit 2
fi

missing=$($PY - <<'PYEOF'
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack", "msgspec": "msgspec", "safetensors": "safetensors",
        "transformers": "transformers", "tokenizers": "tokenizers", "pytest": "pytest"}
print(" ".join(pkg for module, pkg in need.items() if importlib.util.find_spec(module) is None))
PYEOF
)
if [ -n "$missing" ]; then
    site=/tmp/tandem-gpu-site
    echo "installing into $site: $missing"
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 2
    else
        $PY -m pip install -q --target "$site" $missing || exit 2
    fi
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TANDEM_GPU_REPORT=$REPORT PYTHONUNBUFFERED=1

timeout "${TANDEM_GPU_TIMEOUT_S:-420}" $PY -m pytest tests/gpu -q -s -rs -p no:cacheprovider
rc=$?
[ $rc -eq 124 ] && echo "run_gpu_checks: the test run passed its time limit" >&2
[ -f "$REPORT" ] && echo "report: $REPORT"
exit $rc
