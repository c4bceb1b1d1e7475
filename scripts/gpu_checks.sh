#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (docs/gpu.md gives the figures and what each took):
# the CUDA parity tests; scripts/train_bert.py with BERT-base's encoder (hidden 768, 12 layers,
# 32 x 128 tokens, bf16 autocast, Adagrad) against nn.Embedding on the GPU, at BERT-base's
# vocabulary and at a 250k-row multilingual one, with a 5% cache, a larger one, the owner in a
# thread and in a process, and bounded consistency; and `embedpipe bench`'s simulated
# accelerator step on this machine's CPUs (the GIL released for the whole step, then held for
# 80% of it). Checks run in the order below, the most wanted first; name some to run only those.
# Each log goes to $OUT (default: ./gpu-checks); a check that fails does not stop the others,
# and the script exits non-zero if any failed (2 at once without a CUDA device or for a name
# that is not a check).
#
#   bash scripts/gpu_checks.sh                   # all; embedpipe importable: pip install -e ".[hf]"
#   bash scripts/gpu_checks.sh parity accel      # only these two
set -u
out=${OUT:-gpu-checks}
mkdir -p "$out"
python=${PYTHON:-python3}
failed=0
checks=("$@")
known=(parity bert_30k_5pct accel bert_250k_5pct bert_30k_5pct_thread accel_hold bert_30k_all
       bert_30k_all_process bert_30k_all_bounded bert_250k_20pct)  # in the order they run
for name in ${checks[@]+"${checks[@]}"}; do  # a misspelt name would skip its check silently
    if [[ " ${known[*]} " != *" $name "* ]]; then
        echo "gpu_checks.sh: no check named '$name'; the checks: ${known[*]}" >&2
        exit 2
    fi
done

run() {  # run NAME SECONDS COMMAND...: COMMAND's output to $out/NAME.txt and to stdout
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    grep -v "\] step " "$out/$name.txt" | tail -n 25
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=1
}

bert=(scripts/train_bert.py --device cuda --bf16 --hidden 768 --layers 12 --heads 12
      --seq-len 128 --batch-size 32 --num-workers 4 --optimizer adagrad)

if ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_checks.sh: torch sees no CUDA device here; these checks need one" >&2
    exit 2
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "$(nproc) CPUs; $("$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
} | tee "$out/machine.txt"
want() {  # want NAME: whether NAME is among the checks asked for (all when none are)
    [ ${#checks[@]} -eq 0 ] || [[ " ${checks[*]} " == *" $1 "* ]]
}
all=(--vocab 30522 --cache-rows 30522 --steps 300)  # the whole table cached (89 MiB + its sum)
accel=(-m embedpipe bench --skip rows handoff throughput tokenized model memory cold
       --accel-repeats 7)  # the simulated accelerator step, on this machine's CPUs
want parity && run parity 120 "$python" -m pytest tests/pipe/test_cuda.py -v -s -p no:cacheprovider
want bert_30k_5pct && run bert_30k_5pct 150 \
    "$python" "${bert[@]}" --vocab 30522 --steps 300 --owner process --baseline
want accel && run accel 240 "$python" "${accel[@]}" --json "$out/accel.json"
want bert_250k_5pct && run bert_250k_5pct 180 \
    "$python" "${bert[@]}" --vocab 250002 --steps 200 --owner process --baseline
want bert_30k_5pct_thread && run bert_30k_5pct_thread 100 \
    "$python" "${bert[@]}" --vocab 30522 --steps 300 --owner thread
want accel_hold && run accel_hold 240 \
    "$python" "${accel[@]}" --accel-hold 0.8 --json "$out/accel_hold.json"
want bert_30k_all && run bert_30k_all 150 \
    "$python" "${bert[@]}" "${all[@]}" --owner thread --baseline
want bert_30k_all_process && run bert_30k_all_process 100 \
    "$python" "${bert[@]}" "${all[@]}" --owner process
want bert_30k_all_bounded && run bert_30k_all_bounded 100 \
    "$python" "${bert[@]}" "${all[@]}" --owner thread --max-staleness 1
want bert_250k_20pct && run bert_250k_20pct 180 \
    "$python" "${bert[@]}" --vocab 250002 --steps 200 --cache-rows 50000 --owner process --baseline
exit "$failed"
