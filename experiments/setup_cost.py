r"""What each example's set-up costs, with and without skipping the input's padding rows.

  python -m experiments.setup_cost                       # the big demo targets, EnDe and CNN/DM
  python -m experiments.setup_cost --tasks ende --num_examples 100

Every decode call first runs the set-up both decoders pay once per example: the encoder on
the input and the cross-attention K/V of every decoder layer. A decode call runs its input
at a power-of-two length bucket (`decoding.runner.length_bucket`: one compile per bucket),
and the CPU kernel multiplies only the rows up to the last real token
(`t5.SKIP_PADDING_ROWS`, `cpu_matmul.matmul(rows=)`): the padding up to the bucket is
masked everywhere, so its products are skipped, not computed. This measures the set-up of
each example of a task's test split at batch 1, as `decoding.run` trims it, with the
skipping on and off: one compiled program per bucket and setting, compiled before timing,
the settings taking turns over `--rounds` rounds (the order reversed every other round).
Reports the mean real length and bucket, the milliseconds per example of both settings
(median over rounds), and their ratio. Writes <results_dir>/setup_cost.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

from experiments import harness
from experiments.harness import Column, fmt

TASKS = {"ende": ("synthetic_ende", "demo:ende_target_big", 32),
         "cnndm": ("synthetic_cnndm", "demo:cnndm_target_big", 320)}


def measure(args) -> list[dict[str, Any]]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode.decoding import runner
  from spec_decode.models import t5
  rows = []
  for name in args.tasks:
    task, target, input_length = TASKS[name]
    models = harness.load_models(target)
    model = models.target
    params = model.decode_params(models.target_params)
    inputs = harness.task_inputs(task, split="test", num_examples=args.num_examples,
                                 input_length=input_length, decode_len=args.decode_len)
    tokens = [jnp.asarray(runner.trim_padding(inputs[i:i + 1])) for i in range(len(inputs))]
    set_up = lambda p, t: model.init_cache(p, model.encode(p, t), args.decode_len)
    compiled = {}
    for skip in (True, False):
      with t5.switched(SKIP_PADDING_ROWS=skip):  # compiled with this setting
        compiled[skip] = {t.shape: jax.jit(set_up).lower(params, t).compile()
                          for t in {t.shape: t for t in tokens}.values()}
    for fns in compiled.values():  # warm-up
      for t in tokens:
        jax.block_until_ready(fns[t.shape](params, t))
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
      for skip in ((True, False) if r % 2 == 0 else (False, True)):
        fns = compiled[skip]
        start = time.perf_counter()
        for t in tokens:
          jax.block_until_ready(fns[t.shape](params, t))
        times[skip].append((time.perf_counter() - start) / len(tokens))
    real = (inputs > 0).sum(axis=1)
    skip_ms, all_ms = (1e3 * float(np.median(times[s])) for s in (True, False))
    row = {"task": task, "target": target, "examples": len(tokens),
           "real_length": float(real.mean()),
           "bucket": float(np.mean([t.shape[1] for t in tokens])),
           "all_ms": all_ms, "skip_ms": skip_ms, "ratio": all_ms / skip_ms,
           "rounds_ms": {"skip": [1e3 * x for x in times[True]],
                         "all": [1e3 * x for x in times[False]]}}
    rows.append(row)
    print(f"{task}: inputs {row['real_length']:.1f} tokens in buckets of "
          f"{row['bucket']:.1f}: set-up {all_ms:.2f} ms every row, {skip_ms:.2f} ms real rows "
          f"only ({row['ratio']:.2f}X)", flush=True)
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.setup_cost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default="ende,cnndm", help=f"comma list of {sorted(TASKS)}")
  p.add_argument("--num_examples", type=int, default=40)
  p.add_argument("--decode_len", type=int, default=48, help="cache slots of the set-up")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.tasks = [t for t in args.tasks.split(",") if t]
  unknown = [t for t in args.tasks if t not in TASKS]
  if unknown or not args.tasks:
    p.error(f"--tasks must name some of {sorted(TASKS)}, got {unknown or 'none'}")
  if min(args.num_examples, args.decode_len, args.rounds) < 1:
    p.error("--num_examples, --decode_len and --rounds must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  cols = [Column("task", "task"), Column("target", "target"), Column("examples", "examples"),
          Column("real_length", "mean input tokens", lambda v: fmt(v, 1)),
          Column("bucket", "mean bucket", lambda v: fmt(v, 1)),
          Column("all_ms", "set-up, every row", lambda v: f"{v:.2f} ms"),
          Column("skip_ms", "set-up, real rows only", lambda v: f"{v:.2f} ms"),
          Column("ratio", "speedup", lambda v: f"{v:.2f}X")]
  notes = [f"Batch 1, each example's input trimmed to its power-of-two bucket as "
           f"`decoding.run` does; set-up = encoder + cross-attention K/V of every decoder "
           f"layer ({args.decode_len} cache slots); milliseconds per example, median over "
           f"{args.rounds} interleaved rounds, compilation excluded.",
           "'every row': the kernel multiplies the padding rows up to the bucket too (the "
           "behaviour before the kernel took a row count); 'real rows only': up to the last "
           "real token (`t5.SKIP_PADDING_ROWS`, the default). The states of real tokens are "
           "the same bits either way (tests/test_cpu_matmul.py)."]
  return harness.Output("setup_cost", "Set-up per example, skipping padding rows or not",
                        cols, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.setup_cost", argv, parse_args, run)


if __name__ == "__main__":
  main()
