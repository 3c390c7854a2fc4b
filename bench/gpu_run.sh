#!/bin/bash
# The prepared device check, one script for a lent GPU machine (docs/benchmarks/gpu.md records its runs):
#   bash bench/gpu_run.sh            # OUT=dir for the logs (default gpu-out/)
# 1. installs this package (and, where the machine has no package index, the wheels in .whl/: pip download them here
#    for the machine's Python first), 2. builds the benchmark model with the demo tokenizer, 3. bench/gpu_check.py
# (exactness at every fraction and policy, decode ms/token, bytes moved, a profile of the all-resident step),
# 4. the families' and quantized releases' exactness tests on cuda, 5. fresh `moe-offload generate` processes as a
# user runs them (64 tokens; all resident, and half the experts under each policy; decode steps captured as CUDA
# graphs, and once with MOE_OFFLOAD_GRAPH=0: transformers' modules, the path before the graph), 6. llama.cpp's CUDA
# build (bench/gpu_llamacpp.py: built in the background from .gpu/llama.cpp.tar.gz, which `python
# bench/gpu_llamacpp.py pack` writes here and the device tool carries) on the bf16 GGUF of the same checkpoint.
export PYTHONUNBUFFERED=1 OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el install
SITE=/tmp/gpu-site
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 3
fi
export PYTHONPATH=$SITE
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target $SITE . \
  > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 4; }
export HOME=${GPU_HOME:-/tmp/gpu-home}; mkdir -p "$HOME"
nvidia-smi -L
python3 -c "import torch,transformers,sys;print(sys.version.split()[0],torch.__version__,transformers.__version__,torch.cuda.get_device_name(0))"
lscpu | grep -E "Model name"; nproc
if [ -f .gpu/llama.cpp.tar.gz ] && command -v nvcc >/dev/null; then  # llama.cpp's CUDA build, beside everything below
  (nice -n 5 python3 bench/gpu_llamacpp.py build --jobs "${LLAMA_JOBS:-10}" > "$OUT/llama_build.log" 2>&1 &)
else
  echo "llama.cpp: no .gpu/llama.cpp.tar.gz or no nvcc: its CUDA build is skipped" | tee "$OUT/llama_build.log"
fi
el build_model
M=/tmp/gpu-benchmodel
python3 -c "import sys;sys.path.insert(0,'bench');from pathlib import Path;from bench_engine import build_model;\
build_model(Path('$M'));from moe_offload.demo import build_tokenizer;build_tokenizer().save_pretrained('$M')" >/dev/null 2>&1
el gpu_check
timeout "${GC_T:-240}" python3 bench/gpu_check.py --skip-family-tests --model-dir $M --profile 2>&1 | grep -v '^{"' \
  | tee "$OUT/gpu_check.log"
el family_tests
timeout "${FT_T:-150}" python3 -m pytest -q -p no:warnings -p no:cacheprovider --timeout 120 -k cuda \
  tests/engines/offload/test_exactness.py tests/engines/offload/loading/test_quantized.py 2>&1 | tail -40 \
  | tee "$OUT/family_tests.log"
el generate
for a in "--fraction 1.0" "--fraction 0.5 --policy static" "--fraction 0.5 --policy lru" "--fraction 0.5 --policy hybrid" \
         "MODULES --fraction 1.0"; do
  t=$(date +%s%N)
  env=(); [ "${a%% *}" = MODULES ] && { env=(MOE_OFFLOAD_GRAPH=0); a=${a#MODULES }; }
  # shellcheck disable=SC2086
  env "${env[@]}" timeout 60 python3 -m moe_offload.cli generate --model $M --backend cuda $a --max-tokens 64 --ignore-eos --json \
    --prompt "The quick brown fox jumps over the lazy dog" 2>/tmp/gpu-g.err > /tmp/gpu-g.json
  echo "rc=$? wall $(( ($(date +%s%N) - t) / 1000000 )) ms" | tee -a "$OUT/generate.log"; tail -c 400 /tmp/gpu-g.err
  python3 -c "import json;s=json.load(open('/tmp/gpu-g.json'))['stats'];\
print('${env[*]} $a', {k: s[k] for k in s if any(w in k for w in ('ms', 'hit', 'bytes', 'tok'))})" 2>&1 | cut -c1-600 \
    | tee -a "$OUT/generate.log"
done
el llama_cpp
for _ in $(seq "${LLAMA_WAIT:-120}"); do grep -qE "^built|failed|skipped" "$OUT/llama_build.log" && break; sleep 1; done
tail -3 "$OUT/llama_build.log"
if grep -q "^built" "$OUT/llama_build.log"; then
  timeout "${LB_T:-180}" python3 bench/gpu_llamacpp.py bench --model-dir $M 2>&1 | grep -v "^converting\|^wrote" \
    | tee "$OUT/llama_bench.log"
fi
el done
