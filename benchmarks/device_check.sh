#!/usr/bin/env bash
# The CUDA checks and GPU figures of issue #21, prepared to run in one call of a lent GPU machine (the
# team's `device` tool: about 15 minutes of device time per session, 10 minutes per command).
#
#   here, once:  bash benchmarks/device_check.sh --fetch-wheels
#                (pip downloads what that machine's image lacks into .whl/, which git ignores)
#   there:       run(command="bash benchmarks/device_check.sh", carry=[".whl", ".cache"], timeout_s=590)
#                (.cache holds the open_nsfw model the tests read: caffe-compat models fetch open_nsfw)
#
# Every stage has its own time limit (STAGE_LIMITS below, 560 s in all), so a stage that hangs or fails
# leaves the others their time; each writes its output under $OUT (the files the tool brings back) and
# summary.txt says how each ended.  Off a GPU machine (OUT unset) it writes to ./device_out and runs
# the CPU rows, which checks the script itself: DEVICE=cpu bash benchmarks/device_check.sh
#
# Stages: env (versions, GPU); tests (every test that runs on CUDA: device-parametrised [cuda] cases, the
# CUDA-graph and pinned-memory tests); fappy (bench_fappy on CUDA, B = 128 and 150); losses
# (bench_metric_losses on CUDA); train (the authors' CUB step at batch 128 against the hand-written
# nn.Module, fp32 with TF32 off, channels_last, bf16, each also as CUDA graphs, while nvidia-smi samples
# the GPU's utilisation);
# compile (the same step compiled).  ONNX Runtime's CUDA execution provider is not among them: its wheel
# (~280 MB) is larger than what one call may carry (64 MiB).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(lmdb==3.0.0 pytorch-metric-learning==2.9.0 pydot==4.0.1)
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$wheel" || exit 1
  done
  ls -l .whl
  exit 0
fi

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/device_site \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/device_site"
fi

declare -A STAGE_LIMITS=([env]=30 [tests]=180 [fappy]=50 [losses]=50 [train]=150 [compile]=100)
: >"$OUT/summary.txt"

stage() {  # stage NAME COMMAND...: run it under its limit, output to $OUT/NAME.txt, one line in summary.txt
  local name=$1 started=$SECONDS rc
  shift
  timeout "${STAGE_LIMITS[$name]}" "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  printf '%-8s rc=%-3s %4d s%s\n' "$name" "$rc" $((SECONDS - started)) \
    "$([ "$rc" = 124 ] && echo '  (stopped at its limit)')" | tee -a "$OUT/summary.txt"
}

stage env bash -c "$PY - <<'EOF'
import platform, torch, numpy, cv2, onnxruntime
print('python', platform.python_version(), 'torch', torch.__version__, 'numpy', numpy.__version__,
      'opencv', cv2.__version__, 'onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers())
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')
EOF
nvidia-smi || true"

if [ "$DEVICE" = cuda ]; then
  selection=(-k "cuda or CUDA or pinned")
else
  selection=(-k "cuda or CUDA or pinned" --co)  # off a GPU: list what would run
fi
stage tests $PY -m pytest -q -rfE -p no:cacheprovider "${selection[@]}" tests

stage fappy $PY benchmarks/bench_fappy.py --device "$DEVICE" --repeats 21
stage losses $PY benchmarks/bench_metric_losses.py --device "$DEVICE"

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 500 >"$OUT/gpu_util.csv" 2>&1 &
  sampler=$!
  stage train $PY benchmarks/bench_train.py --device cuda --variants all --iters 10 --lmdb-size 256
  kill "$sampler" 2>/dev/null
  stage compile $PY benchmarks/bench_train.py --device cuda --variants fp32 --iters 10 --lmdb-size 0 --compile
else
  stage train $PY benchmarks/bench_train.py --device cpu --variants fp32 --iters 2 --lmdb-size 0 --batch 2
fi
