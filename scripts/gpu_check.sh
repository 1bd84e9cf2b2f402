#!/usr/bin/env bash
# The prepared check for a lent H200 (the `device` tool's run; under 8 minutes). Once, here:
#   echo /.whl/ >> .git/info/exclude; echo /.gpu/ >> .git/info/exclude
#   python scripts/gpu_synth.py prepare ~/.cache/ubatch/gemma-3-270m-q4_k_m.gguf .gpu
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform any -d .whl gguf==0.19.0
# then run with carry [".whl", ".gpu"] and the command: bash scripts/gpu_check.sh
# The device has torch 2.11 and triton 3.6 but not gguf: carried wheels install from .whl with
# --no-index (nothing comes from the network). Extra arguments go to scripts/gpu_check.py
# (--device cpu: the dry run here, in Triton's interpreter on tiny shapes; it takes longer than
# the GPU run: GPU_CHECK_TIMEOUT=1500).
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ -n "${OUT:-}" ]; then
  set -o pipefail
  timeout "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
else
  timeout "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py "$@"
fi
# tensor parallelism over NCCL: a tiny llama's greedy text on 2 GPUs against 1 (with 2 or more GPUs)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$NGPU" -ge 2 ]; then
  echo "== -tp: 2 ranks over NCCL on $NGPU GPUs, greedy text against one GPU"
  timeout 240 "$PY" - <<'PY'
import subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_models import TinySpec, write_tiny_model
m = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama.gguf", TinySpec(arch="llama"))
cmd = [sys.executable, "-m", "ubatch", "cli", "-m", str(m), "-p", "hello world", "-n", "32", "--temp", "0",
       "-no-cnv", "--no-display-prompt", "--log-disable", "--device", "cuda"]
one = subprocess.run(cmd, capture_output=True, text=True)
two = subprocess.run([*cmd, "-tp", "2"], capture_output=True, text=True)
print("one GPU rc", one.returncode, "| two ranks rc", two.returncode, "| same text:", one.stdout == two.stdout)
print(two.stderr[-2000:])
PY
else
  echo "== -tp: skipped: this machine has $NGPU GPU(s); tensor parallelism over NCCL needs two or more"
fi
