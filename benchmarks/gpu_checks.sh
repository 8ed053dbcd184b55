#!/usr/bin/env bash
# The checks that need one NVIDIA GPU, in one run: the CUDA-only tests, the copy-kernel
# benchmark (bf16 and fp32 collective buffers), the step benchmark at world size 1
# (NCCL) on three GPT sizes, the largest also with Inductor codegen, and the step at world
# size 8 under the fake process group (communication free) on the same three; then the
# default options (codegen "auto": Inductor on CUDA) against eager FSDP2 and FSDP2 with
# per-block torch.compile, bf16 and fp32, on the 156M GPT and a 1.1B HF Llama, at fake
# world 8 and world size 1. Results (JSON and one log) go to $OUT, else
# benchmarks/results/gpu. ONLY (a bash regex) runs just the parts whose names match it;
# PEAK_TFLOPS (bf16 dense, default 989: H100/H200 SXM) and its fp32 counterpart
# PEAK_TFLOPS_FP32 (default 67) give MFU.
#
#     bash benchmarks/gpu_checks.sh
#     ONLY="CUDA tests|fake world" bash benchmarks/gpu_checks.sh
#     ONLY="defaults" bash benchmarks/gpu_checks.sh
#
# Each part has its own time limit, so one that fails or hangs does not cost the others.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee "$out/gpu_checks.log") 2>&1

part() {  # part SECONDS NAME COMMAND...: run one check under a limit, say how it ended
    local limit=$1 name=$2 start=$SECONDS rc
    shift 2
    [[ -z "${ONLY:-}" || "$name" =~ $ONLY ]] || return 0
    echo "=== $name"
    timeout "$limit" "$@"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"

# -o addopts=: the CUDA tests serially, without the suite's pytest-xdist workers (not installed there)
part 90 "CUDA tests" python3 -m pytest -q -p no:cacheprovider -o addopts= tests/kernels/test_kernels.py -k "cuda or h100 or dispatch or block" \
    tests/test_training_features.py::test_offload_keeps_shards_gradients_and_optimizer_state_in_pinned_cpu_memory
part 100 "kernels, bf16 buffers" python3 benchmarks/bench_kernels.py --repeats 5 --sizes-mb 1 4 16 64 256 --out "$out/kernels_bf16.json"
part 45 "kernels, fp32 buffers" python3 benchmarks/bench_kernels.py --repeats 5 --comm-dtype fp32 \
    --sizes-mb 4 64 256 --params 10 100 1000 --out "$out/kernels_fp32.json"
step="torchrun --standalone --nproc-per-node 1 benchmarks/bench_step.py --systems compshard,fsdp2,ddp --warmup 3"
part 75 "step, small GPT" $step --steps 30 --out "$out/step_small.json"
part 75 "step, 47 MiB GPT" $step --steps 30 --size bandwidth --out "$out/step_bandwidth.json"
part 110 "step, 12 x 1024 GPT" $step --steps 20 --size bandwidth --layers 12 --width 1024 --heads 16 --seq 512 \
    --out "$out/step_large.json"
part 120 "step, 12 x 1024 GPT, Inductor codegen" $step --steps 20 --size bandwidth --layers 12 --width 1024 --heads 16 \
    --seq 512 --systems compshard --options '{"codegen": "inductor"}' --out "$out/step_large_inductor.json"
fake="python3 benchmarks/bench_step.py --fake-world 8 --systems compshard,fsdp2 --warmup 3 --batch 64"
part 60 "step at fake world 8, small GPT" $fake --steps 30 --out "$out/fake8_small.json"
part 75 "step at fake world 8, 47 MiB GPT" $fake --steps 30 --size bandwidth --out "$out/fake8_bandwidth.json"
part 150 "step at fake world 8, 12 x 1024 GPT" $fake --steps 20 --size bandwidth --layers 12 --width 1024 --heads 16 \
    --seq 512 --out "$out/fake8_large.json"

# The defaults against eager FSDP2 and FSDP2 with per-block compile, in the same run:
# fake world 8 and world size 1, bf16 then fp32, the 156M GPT and the 1.1B Llama first
# (the issue's targets), then the small and 47 MiB GPTs; last, FSDP2 + full-model
# compile on the 156M GPT (graph breaks at FSDP2's hooks: it may not run).
vs="--systems compshard,fsdp2,fsdp2+compile-blocks"
declare -A model=(
    ["156M GPT"]="--size bandwidth --layers 12 --width 1024 --heads 16 --seq 512"
    ["1.1B Llama"]="--model llama"
    ["small GPT"]="--size small"
    ["47 MiB GPT"]="--size bandwidth"
)
declare -A precision=(
    [bf16]="--dtype bf16 --peak-tflops ${PEAK_TFLOPS:-989}"
    [fp32]="--dtype fp32 --peak-tflops ${PEAK_TFLOPS_FP32:-67}"
)
declare -A world=(
    ["fake world 8"]="python3 benchmarks/bench_step.py --fake-world 8 --batch 64"
    ["world 1"]="torchrun --standalone --nproc-per-node 1 benchmarks/bench_step.py --batch 8"
)
for w in "fake world 8" "world 1"; do
    for dtype in bf16 fp32; do
        for m in "156M GPT" "1.1B Llama" "small GPT" "47 MiB GPT"; do
            name="defaults, $w, $m, $dtype"
            file="defaults_${w// /_}_${m// /_}_$dtype.json"
            limit=$([[ $m == "1.1B Llama" ]] && echo 320 || echo 200)
            part "$limit" "$name" ${world[$w]} --warmup 2 --steps 15 ${model[$m]} ${precision[$dtype]} $vs \
                --out "$out/$file"
        done
    done
done
part 200 "defaults, fake world 8, 156M GPT, bf16, full-model compile" ${world["fake world 8"]} --warmup 2 --steps 15 \
    ${model["156M GPT"]} ${precision[bf16]} --systems fsdp2,fsdp2+compile --out "$out/defaults_full_model_compile.json"
