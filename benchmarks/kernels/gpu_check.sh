#!/usr/bin/env bash
# GPU checks on a bare GPU machine, e.g. a leased device with no network:
#   bash benchmarks/kernels/gpu_check.sh [--out DIR]     (DIR defaults to $OUT, else build/gpu_check/)
# Uses the machine's python3 when it already has a CUDA torch and CuPy (the H200 image does:
# torch 2.11+cu130, cupy-cuda13x); otherwise installs them from PyPI, matching CuPy to the
# driver's CUDA major version. Runs from the repository root with the repo on PYTHONPATH, so no
# install of pagedserve itself is needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then  # `make gpu-wheels`: no package index needed
  mapfile -t wheels < <("$PY" benchmarks/kernels/device_wheels.py .whl)  # only those the machine lacks
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/pagedserve-site "${wheels[@]}"
  fi
  export PYTHONPATH="/tmp/pagedserve-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import cupy, torch, zmq; assert torch.cuda.is_available()" 2>/dev/null; then
  major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
  echo "gpu_check: installing torch and cupy-cuda${major:-12}x from PyPI" >&2
  "$PY" -m pip install -q torch "cupy-cuda${major:-12}x" transformers safetensors tokenizers msgspec msgpack pyzmq tqdm numpy pytest
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.kernels.gpu_check "$@"
