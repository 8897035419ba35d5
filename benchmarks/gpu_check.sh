#!/usr/bin/env bash
# The GPU path, measured on a CUDA machine (a few minutes on one GPU; not yet run on one):
#   1. where llama.cpp samples (device, layers offloaded);
#   2. our sides of the SFT benchmark (tok/s) and of the GRPO benchmark (s/update);
#   3. the GRPO benchmark's run under `retrograd profile` at training.max_gpu_duty_cycle = 1 and
#      0.5: s/update and the scheduler's observed duty cycle.
# Around each run nvidia-smi samples GPU 0 every 100 ms: the VRAM peak (torch and llama.cpp
# together, above what was in use before the run) and the mean GPU utilization (the duty cycle
# as the GPU saw it). A machine without a CUDA GPU gets one line and exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}

if ! nvidia-smi -L >/dev/null 2>&1 || ! "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here (nvidia-smi and torch.cuda.is_available() must both see one); on the CPU run sft_vs_trl.py and grpo_vs_trl.py" >&2
    exit 2
fi
tmp=$(mktemp -d)
trap 'jobs -p | xargs -r kill 2>/dev/null || true; rm -rf "$tmp"' EXIT

measured() {  # NAME COMMAND...: run it (output kept in $tmp/NAME.out) while nvidia-smi samples GPU 0
    local name=$1 before sampler
    shift
    before=$(nvidia-smi --id=0 --query-gpu=memory.used --format=csv,noheader,nounits)
    nvidia-smi --id=0 --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 100 > "$tmp/$name.smi" &
    sampler=$!
    "$@" | tee "$tmp/$name.out"
    kill "$sampler"
    wait "$sampler" || true
    awk -F', *' -v name="$name" -v before="$before" '
        { if ($1 > peak) peak = $1; util += $2; n++ }
        END { printf "%-9s VRAM peak %6d MiB above the %d MiB in use before; mean GPU utilization %3.0f%% (%d samples)\n",
              name, peak - before, before, util / n, n }' "$tmp/$name.smi" >> "$tmp/summary"
}

echo "== device"
nvidia-smi --id=0 --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$python" - <<'EOF'
from retrograd.llamacpp import gpu_offload_warning
from retrograd.sampler import Sampler, SamplerOptions

with Sampler(None, SamplerOptions(n_ctx=64, n_seq_max=2)) as sampler:
    print(f"llama.cpp sampler: {sampler.placement.describe()}")
print(gpu_offload_warning(True) or "llama.cpp has GPU offload")
EOF

echo "== SFT"
measured sft "$python" benchmarks/sft_vs_trl.py --sides ours-f32,ours-bf16
echo "== GRPO"
measured grpo "$python" benchmarks/grpo_vs_trl.py --sides ours-auto
echo "== duty cycle"
"$python" benchmarks/grpo_vs_trl.py --write-config "$tmp/duty-1.0" > /dev/null
"$python" benchmarks/grpo_vs_trl.py --write-config "$tmp/duty-0.5" --duty-cycle 0.5 > /dev/null
measured duty-1.0 "$python" -m retrograd profile "$tmp/duty-1.0/grpo.toml" --full
measured duty-0.5 "$python" -m retrograd profile "$tmp/duty-0.5/grpo.toml" --full

echo "== summary"
grep -h -e "^CPU" -e "^tok/s steady" -e "^update s, median" -e "^  train total" "$tmp/sft.out" "$tmp/grpo.out" || true
for run in duty-1.0 duty-0.5; do
    grep -e "^duty cycle" -e "^  device peak" -e "^Summary" "$tmp/$run.out" | sed "s/^ */$run: /" || true
done
cat "$tmp/summary"
