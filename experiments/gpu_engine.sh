#!/usr/bin/env bash
# The engine at T5-XXL shapes on one lent GPU (issue 35), in one call of the device tool:
#
#   bash experiments/gpu_engine.sh COMMIT [engine|variants|one_row|one_row_kinds]
#
# engine (the default plan): the measurements below. variants: what a step launches and
# what XLA's options change (experiments/step_variants: the drafts' and the XXL target's
# steps with CUDA graphs off, on for loops too, cuBLAS-only GEMMs), then the XXL target
# end to end with a copy of itself as the draft (alpha about 1 at t=0: the engine's
# model-work bound with every proposal accepted). one_row: one-row products stacked to two
# rows (`models.t5.ONE_ROW_AS_TWO`, the default on GPUs) against XLA's one-row lowering:
# the steps of the drafts and the XXL target, then the XXL / small benchmark before
# (one_row_as_one) and after. one_row_kinds: the demo-target-shaped step at batch 1 (the
# project's stacking, stacking by broadcast, none; and the self-attention as summed
# multiplies, which on the CPU removed copies of every KV cache from such a step,
# `models.t5.ROWWISE_SELF_ATTENTION`) and at batch 8, each loop's optimized HLO saved for
# `experiments.step_variants --kinds`.
#
# run from the repository root on the GPU machine (its python3 holds JAX with CUDA; nothing
# here needs gin or seqio). COMMIT names the checkout in the result files: the git history
# on that machine need not be the tree's (one run there reported an older commit). Steps run in order of priority, each under its own time
# limit, so a slow compile cuts a step short rather than the call; each step's log keeps
# the figures it printed before it was stopped. Everything (the experiments' .md/.csv/.json
# and the logs) is packed into $OUT/gpu_results.tgz after every step; the last lines of
# each log are printed. Random bfloat16 weights: step costs are real, alpha is not.
# On an H200 (2026-11-26) the steps took 159, 80, over 64 and about 90 + 90 s (compiles of
# the 24-layer XXL loops dominate): about 9 minutes, inside one call's 600 s.
# `python -m experiments.gpu_report --dir DIR` turns the unpacked results into DIR/README.md.
set -u
COMMIT=${1:-unknown}
PLAN=${2:-engine}
OUT=${OUT:-/tmp/gpu_out}
RES=/tmp/gpu_results
mkdir -p "$OUT" "$RES"
export SPEC_DECODE_COMMIT=$COMMIT PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
XXL=(--target t5_1_1_xxl --dtype bfloat16 --input_length 512 --decode_len 128 --copy_mib 4096)

ARCHIVE=gpu_results.tgz
STEP_LINES='^\[benchmark\]|^t5_1_1|^\| |Error|error:|T_p|T_q|roofline|speedup|model work'
source "$(dirname "$0")/gpu_steps.sh"

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import jax, flax, numpy; print('jax', jax.__version__, 'flax', flax.__version__, \
'numpy', numpy.__version__, jax.devices())"
} 2>&1 | tee "$RES/env.log"

if [ "$PLAN" = one_row_kinds ]; then
  # The kernels a one-row step adds (batch 1 against 8, at the demo target's shape) and
  # whether stacking by a broadcast removes the concatenation kernels; the saved modules go
  # to `python -m experiments.step_variants --kinds`.
  V=(--models t5_1_1_small --dtype bfloat16 --vocab_size 1536 --input_length 32
     --position 16 --repeats 3 --tokens 1,5 --save_hlo --results_dir "$RES")
  step kinds_b1 190 $PY -m experiments.step_variants "${V[@]}" --batch_size 1 \
    --variants project,one_row_as_two_broadcast,one_row_as_one,self_attention_rowwise \
    --name step_one_row_kinds_b1
  step kinds_b8 60 $PY -m experiments.step_variants "${V[@]}" --batch_size 8 \
    --variants project --name step_one_row_kinds_b8
  date -u +%FT%TZ
  exit 0
fi

if [ "$PLAN" = one_row ]; then
  V=(--dtype bfloat16 --vocab_size 32128 --input_length 512 --position 64 --repeats 5)
  step one_row_drafts 120 $PY -m experiments.step_variants "${V[@]}" \
    --models t5_1_1_small,t5_1_1_base --tokens 1,5 --variants one_row_as_one,project \
    --name step_one_row_drafts --results_dir "$RES"
  step one_row_xxl 110 $PY -m experiments.step_variants "${V[@]}" --models t5_1_1_xxl \
    --tokens 1,8 --variants one_row_as_one,project --name step_one_row_xxl --results_dir "$RES"
  B=("${XXL[@]}" --draft t5_1_1_small --batch_size 1 --gammas 3,5 --num_examples 2
     --e2e_repeats 2 --repeats 3 --inner 2 --results_dir "$RES")
  step xxl_small_before 120 $PY -c "import sys; from spec_decode.models import t5; \
t5.ONE_ROW_AS_TWO = False; from experiments import benchmark; benchmark.main(sys.argv[1:])" \
    "${B[@]}" --name gpu_xxl_small_b1_one_row_as_one
  step xxl_small_after 120 $PY -m experiments.benchmark "${B[@]}" --name gpu_xxl_small_b1
  date -u +%FT%TZ
  exit 0
fi

if [ "$PLAN" = variants ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # two XXL copies (44 GB) and the copy test
  V=(--dtype bfloat16 --vocab_size 32128 --input_length 512 --position 64 --repeats 5)
  step draft_variants 150 $PY -m experiments.step_variants "${V[@]}" \
    --models t5_1_1_small,t5_1_1_base --tokens 1 --name step_variants_drafts \
    --variants project,no_command_buffers,loop_command_buffers,unrolled_loop_command_buffers,no_triton_gemm \
    --results_dir "$RES"
  step large_step 45 $PY -m experiments.step_variants "${V[@]}" --models t5_1_1_large \
    --tokens 1 --variants project --name step_variants_large --results_dir "$RES"
  step xxl_variants 110 $PY -m experiments.step_variants "${V[@]}" --models t5_1_1_xxl \
    --tokens 1,8 --variants project,loop_command_buffers --name step_variants_xxl \
    --results_dir "$RES"
  step xxl_copy_b1 150 $PY -m experiments.benchmark "${XXL[@]}" --draft t5_1_1_xxl \
    --draft_seed 0 --batch_size 1 --gammas 3 --num_examples 2 --e2e_repeats 1 --repeats 3 \
    --inner 2 --name gpu_xxl_copy_b1 --results_dir "$RES"
  date -u +%FT%TZ
  exit 0
fi

# 1. Batch 1, the small draft: T_p against the memory roofline, T_q, c, T_verify(N)/T_p for
#    N = 2..11, end to end and the engine's model-work bound.
step xxl_small_b1 230 $PY -m experiments.benchmark "${XXL[@]}" --draft t5_1_1_small \
  --batch_size 1 --gammas 1,2,3,4,5,7,10 --num_examples 4 --e2e_repeats 2 --repeats 5 \
  --inner 2 --name gpu_xxl_small_b1 --results_dir "$RES"
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 130 ]; then
  echo "=== the first step failed (not a time limit): stopping"; tail -n 40 "$RES/xxl_small_b1.log"
  exit 1
fi

# 2. T_verify(N)/T_p for N = 16 .. 1024 (batch 1, cache filled to 64).
step xxl_verify_n 110 $PY -m experiments.verify_scaling --models t5_1_1_xxl --dtype bfloat16 \
  --vocab_size 32128 --input_length 512 --position 64 --tokens 16,64,256,1024 --repeats 3 \
  --results_dir "$RES/verify_n"

# 3. The drafts' single-token steps: T5.1.1-small / base / large shapes (c = T_q / T_p).
step drafts 100 $PY -m experiments.verify_scaling \
  --models t5_1_1_small,t5_1_1_base,t5_1_1_large --dtype bfloat16 --vocab_size 32128 \
  --input_length 512 --position 64 --tokens 5 --repeats 3 --results_dir "$RES/drafts"

# 4. Batch 8 and 32, the small draft: T_p and T_verify(N)/T_p (no end-to-end run).
for b in 8 32; do
  step "xxl_small_b$b" 140 $PY -m experiments.benchmark "${XXL[@]}" --draft t5_1_1_small \
    --batch_size "$b" --gammas 3,7 --no_e2e --repeats 3 --inner 2 \
    --name "gpu_xxl_small_b$b" --results_dir "$RES"
done
date -u +%FT%TZ
