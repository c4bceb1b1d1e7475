#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (about five minutes on an H200: the sum of its
# parts' times there; docs/gpu.md gives the figures, the page's profile, switch-interval and
# 5%-cache owner-process runs were made by hand): the CUDA parity tests, then
# scripts/train_bert.py with BERT-base's encoder (hidden 768, 12 layers, 32 x 128 tokens, bf16
# autocast, Adagrad) against nn.Embedding on the GPU, at BERT-base's vocabulary and at a 250k-row
# multilingual one, with a 5% cache, a larger one, the owner in a process and bounded
# consistency. Each log goes to $OUT (default: ./gpu-checks); a check that fails does not stop
# the others, and the script exits non-zero if any failed (2 at once without a CUDA device).
#
#   bash scripts/gpu_checks.sh            # embedpipe importable: pip install -e ".[hf]", or PYTHONPATH
set -u
out=${OUT:-gpu-checks}
mkdir -p "$out"
python=${PYTHON:-python3}
failed=0

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
run parity 120 "$python" -m pytest tests/pipe/test_cuda.py -v -s -p no:cacheprovider
all=(--vocab 30522 --cache-rows 30522 --steps 300)  # the whole table cached (89 MiB + its sum)
run bert_30k_5pct 150 "$python" "${bert[@]}" --vocab 30522 --steps 300 --baseline
run bert_30k_all 150 "$python" "${bert[@]}" "${all[@]}" --baseline
run bert_30k_all_process 100 "$python" "${bert[@]}" "${all[@]}" --owner process
run bert_30k_all_bounded 100 "$python" "${bert[@]}" "${all[@]}" --max-staleness 1
run bert_250k_5pct 180 "$python" "${bert[@]}" --vocab 250002 --steps 200 --baseline
run bert_250k_20pct 180 "$python" "${bert[@]}" --vocab 250002 --steps 200 --cache-rows 50000 --baseline
exit "$failed"
