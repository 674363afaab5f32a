#!/usr/bin/env bash
# The trained big demo EnDe pair on one lent GPU: the main job and batch scaling with the
# fallback and in-loop refill (issues 35 and 40), in two calls of the device tool.
#
#   bash experiments/gpu_demo.sh COMMIT stash     # call 1: carry .xfer1
#   bash experiments/gpu_demo.sh COMMIT run       # call 2, at once: carry .xfer2 and .whl
#
# Why two calls: a call takes at most 64 MiB of working tree, and the big target alone is
# 71 MiB of TensorStore chunks (already compressed), so the tracked demo_models/ must stay
# behind and the target travels in two halves. Here, before the calls (restore afterwards):
#   mkdir -p .xfer1/ende_target_big .xfer2/ende_target_big
#   cp -r demo_models/ende_target_big/target.encoder.* .xfer1/ende_target_big/
#   cp -r demo_models/ende_target_big/{checkpoint,target.decoder.*,target.token_embedder.*} \
#     .xfer2/ende_target_big/
#   cp -r demo_models/ende_small .xfer2/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl gin-config==0.5.0
#   mv demo_models /tmp/demo_models_stash     # (the .xfer*/.whl folders git-ignored)
# The stash call copies the first half to /tmp on the device machine, which keeps it while
# the machine stays warm (30 s after a call); the run call finds it there, or stops at once
# (exit 3) if the machine was given back in between.
#
# run: the demo main job (configs/demo/ende_big_experiment.gin, 50 examples, greedy, gamma
# from warm-up measurements) and experiments/batch_scaling at batch 1, 8 and 32 with refill
# (gamma chosen per batch size by the measured costs; 0 = the autoregressive fallback).
# Parameters in bfloat16 (ModelSpec.dtype's default on accelerators). Each step runs under
# its own time limit; results and logs are packed into $OUT/gpu_demo.tgz after every step.
set -u
COMMIT=${1:-unknown}
PLAN=${2:-run}
OUT=${OUT:-/tmp/gpu_out}
RES=/tmp/gpu_demo_results
STASH=${SPEC_DECODE_STASH:-/tmp/spec_decode_stash}
PY=${PYTHON:-python3}
export SPEC_DECODE_COMMIT=$COMMIT PYTHONUNBUFFERED=1

if [ "$PLAN" = stash ]; then
  mkdir -p "$STASH" && cp -r .xfer1/. "$STASH"/ && du -sh "$STASH" && exit 0
  exit 1
fi

[ -d "$STASH/ende_target_big" ] || {
  echo "the first half (stash call) is not on this machine: it was given back in between"
  exit 3; }
mkdir -p "$OUT" "$RES" demo_models
cp -r .xfer2/. demo_models/ && cp -r "$STASH"/. demo_models/ || exit 1
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi

ARCHIVE=gpu_demo.tgz
STEP_LINES='^\| |speedup|Error|error:|alpha|gamma'
source "$(dirname "$0")/gpu_steps.sh"

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import jax, flax, gin; print('jax', jax.__version__, 'flax', flax.__version__, \
jax.devices())"
} 2>&1 | tee "$RES/env.log"

step main_job_t0 ${MAIN_LIMIT:-200} $PY -m spec_decode.main \
  --gin_file=configs/demo/ende_big_experiment.gin --output_dir "$RES/main_job_ende_big_t0" \
  --noprogress ${MAIN_ARGS:-}
step batch_scaling ${BATCH_LIMIT:-270} $PY -m experiments.batch_scaling \
  --batch_sizes ${BATCH_SIZES:-1,8,32} --num_examples ${BATCH_EXAMPLES:-64} --gamma auto \
  --refill_chunk 4 --runs_dir /tmp/gpu_demo_runs --results_dir "$RES" --name gpu
date -u +%FT%TZ
