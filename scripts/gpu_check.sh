#!/usr/bin/env bash
# `make gpu-check`: the one prepared check for a CUDA machine. Installs the [tensorrt] extra,
# builds the tiny (inside the tests) and the SmolLM2 TensorRT engines, runs tests/gpu, a short
# bench/step.py and the batching bench, and prints a summary. Sized for < 8 minutes on one
# modern GPU; every stage has its own time limit so a hang cannot eat the whole budget.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${GPU_CHECK_OUT:-bench/out/gpu-check}
ENGINE=${GPU_CHECK_ENGINE:-engines/smollm2-135m-instruct-trt-bf16}
mkdir -p "$OUT"
declare -A STATUS

stage() {  # stage NAME SECONDS COMMAND... : run, log to $OUT/NAME.txt, remember the exit code
    local name=$1 limit=$2
    shift 2
    local begin=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    STATUS[$name]="exit ${PIPESTATUS[0]} in $((SECONDS - begin))s"
}

make install >/dev/null || exit 1
stage install-extra 240 $PY -m pip install -q -e '.[tensorrt]'
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # torch==2.13.0 from the CPU index has no CUDA: take the same version's CUDA build.
    stage cuda-torch 300 $PY -m pip install -q --force-reinstall --no-deps torch==2.13.0 \
        --index-url "${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
$PY -c "import tensorrt, torch; print('tensorrt', tensorrt.__version__, '| torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"

stage tests-gpu 240 $PY -m pytest tests/gpu -q -ra
stage build-smollm2 240 .venv/bin/ifb build --backend tensorrt --dtype bf16 \
    --max-batch-size 32 --max-num-tokens 512 --max-seq-len 2048 -o "$ENGINE"
stage bench-step 60 $PY bench/step.py --engine "$ENGINE" --repeats 5 --no-hf --output "$OUT/step.json"
stage bench-batching 120 $PY bench/batching.py --engine "$ENGINE" --output "$OUT/batching.json"

echo "== summary"
cat "$OUT/gpu.txt"
for name in install-extra cuda-torch tests-gpu build-smollm2 bench-step bench-batching; do
    [[ -n "${STATUS[$name]:-}" ]] && printf '%-16s %s\n' "$name" "${STATUS[$name]}"
done
tail -n 3 "$OUT/tests-gpu.txt"
grep -E "^(ifb|ms per step)" "$OUT/bench-step.txt"
grep -E "^(mode|one_at|static|in_flight|in-flight)" "$OUT/bench-batching.txt"
failed=0
for name in tests-gpu build-smollm2 bench-step bench-batching; do
    [[ "${STATUS[$name]}" == "exit 0 "* ]] || failed=1
done
exit $failed
