#!/usr/bin/env bash
# The GPU path, measured on a CUDA machine (a few minutes on one GPU):
#   benchmarks/gpu_check.sh [--phases device,sft,grpo,duty] [MODEL.gguf ...]
# MODELs default to the bundled SmolLM2-135M (benchmarks/sized_models.py writes 0.5B and 1.5B ones).
#   device  where llama.cpp runs (device, layers offloaded) on the first model;
#   sft     per model, our sides of the SFT benchmark (f32 and bf16 compute; tok/s);
#   grpo    per model, our side of the GRPO benchmark (auto dtype; s/update, phases);
#   duty    the GRPO benchmark's run on the first model under `retrograd profile` at
#           training.max_gpu_duty_cycle = 1 and 0.5: s/update and the scheduler's observed duty cycle.
# Around each run nvidia-smi samples GPU 0 every 100 ms: the VRAM peak (torch and llama.cpp
# together, above what was in use before the run) and the mean GPU utilization (the duty cycle
# as the GPU saw it). A machine without a CUDA GPU gets one line and exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
phases=device,sft,grpo,duty
if [[ ${1:-} == --phases ]]; then
    phases=$2
    shift 2
fi
models=("$@")

if ! nvidia-smi -L >/dev/null 2>&1 || ! "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here (nvidia-smi and torch.cuda.is_available() must both see one); on the CPU run sft_vs_trl.py and grpo_vs_trl.py" >&2
    exit 2
fi
tmp=$(mktemp -d)
trap 'jobs -p | xargs -r kill 2>/dev/null || true; rm -rf "$tmp"' EXIT
phase() { [[ ",$phases," == *",$1,"* ]]; }
label() { if [[ -n ${1:-} ]]; then basename "$1" .gguf; else echo SmolLM2-135M; fi; }
model_args() { if [[ -n ${1:-} ]]; then echo --model "$1"; fi; }

measured() {  # NAME COMMAND...: run it (output kept in $tmp/NAME.out) while nvidia-smi samples GPU 0
    local name=$1 before sampler status=0
    shift
    before=$(nvidia-smi --id=0 --query-gpu=memory.used --format=csv,noheader,nounits)
    nvidia-smi --id=0 --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 100 > "$tmp/$name.smi" &
    sampler=$!
    "$@" 2>&1 | tee "$tmp/$name.out" || status=$?
    kill "$sampler"
    wait "$sampler" || true
    awk -F', *' -v name="$name" -v before="$before" -v status="$status" '
        { if ($1 > peak) peak = $1; util += $2; n++ }
        END { printf "%-32s VRAM peak %6d MiB above the %d MiB in use before; mean GPU utilization %3.0f%% (%d samples)%s\n",
              name, peak - before, before, util / n, n, status ? "; FAILED, exit " status : "" }' "$tmp/$name.smi" >> "$tmp/summary"
}

echo "== device"
nvidia-smi --id=0 --query-gpu=name,driver_version,memory.total --format=csv,noheader
if phase device; then
    "$python" - "${models[0]:-}" <<'EOF'
import sys

from retrograd.runtime.llamacpp import gpu_offload_warning
from retrograd.sampler import Sampler, SamplerOptions

with Sampler(sys.argv[1] or None, SamplerOptions(n_ctx=64, n_seq_max=2)) as sampler:
    print(f"llama.cpp sampler: {sampler.placement.describe()}")
print(gpu_offload_warning(True) or "llama.cpp has GPU offload")
EOF
fi

for model in "${models[@]:-}"; do
    name=$(label "$model")
    if phase sft; then
        echo "== SFT, $name"
        measured "sft-$name" "$python" benchmarks/sft_vs_trl.py --sides ours-f32,ours-bf16 $(model_args "$model")
    fi
    if phase grpo; then
        echo "== GRPO, $name"
        measured "grpo-$name" "$python" benchmarks/grpo_vs_trl.py --sides ours-auto $(model_args "$model")
    fi
done

if phase duty; then
    name=$(label "${models[0]:-}")
    echo "== duty cycle, $name"
    for duty in 1.0 0.5; do
        "$python" benchmarks/grpo_vs_trl.py --write-config "$tmp/duty-$duty" --duty-cycle $duty $(model_args "${models[0]:-}") > /dev/null
        RETROGRAD_BENCH_MODEL=${models[0]:-} measured "duty-$duty-$name" "$python" -m retrograd profile "$tmp/duty-$duty/grpo.toml" --full
    done
fi

echo "== summary"
for out in "$tmp"/*.out; do
    [[ -e $out ]] || continue
    run=$(basename "$out" .out)
    grep -e "^CPU" -e "^tok/s steady" -e "^update s, median" -e "^  train total" -e "^duty cycle" -e "^  device peak" -e "^Summary" "$out" \
        | sed "s/^ */$run: /" || true
done
cat "$tmp/summary" 2>/dev/null || true
