#!/usr/bin/env bash
# lit_grpo's GPU check, one run of at most 8 minutes on one H200: install the project on the GPU image, run the
# tests marked `gpu`, time GRPO steps on random models of real shapes (benchmarks/gpu_steps.py), and write it all
# to $OUT/gpu_check.md (logs beside it).
#
#   scripts/gpu_check.sh --download-wheels   # where pip reaches a registry: the wheels the GPU image lacks -> .whl/
#   scripts/gpu_check.sh                     # on the GPU machine, .whl/ carried along (43 MiB of the 64 allowed)
#   scripts/gpu_check.sh --dry-run           # on a CPU, under a minute: the same stages on a tiny shape, no install
#
# OUT (a folder) defaults to a new temporary one; WHEELS (default .whl) holds the wheels.
set -uo pipefail
cd "$(dirname "$0")/.."

# pyproject's dependencies that the GPU image (Python 3.12, torch 2.11, transformers 5.17, lightning 2.6, peft)
# lacks, at the versions the project is tested with. The bitsandbytes manylinux wheel is 41 MiB, the rest 2.4 MiB.
WHEEL_SPECS=(bitsandbytes==0.50.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
             datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 jsonargparse==4.53.0
             docstring-parser==0.18.0 typeshed-client==2.15.0)
WHEELS=${WHEELS:-.whl}
GPU_PYTHON=${GPU_PYTHON:-3.12}

mode=gpu
steps_args=()
case "${1:-}" in
  "") ;;
  --dry-run) mode=dry-run; steps_args=(--dry-run) ;;
  --download-wheels)
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEELS" "${WHEEL_SPECS[@]}" || exit
    du -ch "$WHEELS"/*.whl | tail -n 1
    exit ;;
  *) echo "usage: $0 [--dry-run | --download-wheels]" >&2; exit 2 ;;
esac

OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
started=$SECONDS
failed=0

if [ "$mode" = gpu ]; then
  total_s=480
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  {
    # One wheel pip refuses (another Python's, say) would stop them all: then each goes on its own.
    [ ${#wheels[@]} -eq 0 ] || python3 -m pip install --no-index --no-deps "${wheels[@]}" \
      || for wheel in "${wheels[@]}"; do python3 -m pip install --no-index --no-deps "$wheel"; done
  } > "$OUT/install.log" 2>&1
  if python3 -m pip install --no-index --find-links "$WHEELS" --no-build-isolation -e . >> "$OUT/install.log" 2>&1; then
    install="\`pip install -e .\` found every requirement offline (${#wheels[@]} wheels carried)"
  elif python3 -m pip install --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1; then
    install="\`pip install -e .\` could not resolve every requirement offline (install.log); installed with --no-deps"
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    install="\`pip install -e .\` failed (install.log); running from the source tree"
  fi
else
  total_s=150
  export CUDA_VISIBLE_DEVICES=""  # the dry run is the CPU run, wherever it runs
  install="skipped (dry run: the environment stays as it is)"
fi

timeout 180 python3 -m pytest -q -rA -m gpu tests/test_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 || failed=1

budget_s=$((total_s - (SECONDS - started) - 30))
python3 benchmarks/gpu_steps.py "${steps_args[@]}" --budget-s "$budget_s" --out "$OUT/gpu_steps.md" \
  > "$OUT/gpu_steps.log" 2>&1 || failed=1

{
  echo "# lit_grpo GPU check ($mode)"
  echo
  echo "- $(date -u '+%Y-%m-%d %H:%M UTC'); GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    2>/dev/null || echo none)"
  python3 benchmarks/gpu_steps.py --environment
  echo "- install: $install"
  echo
  echo "## Tests marked gpu"
  echo
  echo "\`pytest -m gpu tests/test_gpu.py\`: $(tail -n 1 "$OUT/gpu_tests.log")"
  echo
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' "$OUT/gpu_tests.log" | sed 's/^/- /'
  echo
  echo "## GRPO steps"
  echo
  echo "Random weights in real shapes, bf16 with bf16-mixed, LoRA r=16 (QLoRA: on an NF4 base), beta=0.04,"
  echo "completions sampled to full length (EOS ignored); one step after a warm-up (benchmarks/gpu_steps.py)."
  echo
  cat "$OUT/gpu_steps.md" 2>/dev/null || echo "No table: see gpu_steps.log."
  echo
  echo "Whole check: $((SECONDS - started)) s."
} > "$OUT/gpu_check.md"
cat "$OUT/gpu_check.md"
exit $failed
