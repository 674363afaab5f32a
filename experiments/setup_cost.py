r"""What each example's set-up costs under the ways the project can run it.

  python -m experiments.setup_cost                       # the big demo targets, EnDe and CNN/DM
  python -m experiments.setup_cost --tasks ende --num_examples 100
  python -m experiments.setup_cost --settings every_row,real_rows,bfloat16_dot

Every decode call first runs the set-up both decoders pay once per example: the encoder on
the input and the cross-attention K/V of every decoder layer. It multiplies all of the
input's rows by each weight at once, so it is bound by the CPU's multiply-adds, where a
decode step is bound by reading the weights. The settings (`SETTINGS`):
- real_rows (the default model): a decode call runs its input at a power-of-two length
  bucket (`decoding.runner.length_bucket`: one compile per bucket) and the CPU kernel
  multiplies only the rows up to the last real token (`t5.SKIP_PADDING_ROWS`,
  `cpu_matmul.matmul(rows=)`);
- every_row: the padding rows up to the bucket multiplied too (the behaviour before the
  kernel took a row count; the real tokens' states are the same bits);
- bfloat16_dot: the set-up's weights packed for AVX512-BF16 dot products
  (`T5.setup_kernel_weights` / `ModelSpec.setup_kernel_weights`: activations rounded to
  bfloat16, float32 sums, twice the multiply-adds per instruction), which changes the
  encoder's states: the table gives their largest difference from real_rows', relative to
  the largest state (real tokens; padding states are masked downstream). Left out, with a
  note, on a CPU without AVX512-BF16.
Each example of a task's test split at batch 1, as `decoding.run` trims it: one compiled
program per bucket and setting, compiled before timing, the settings taking turns over
`--rounds` rounds (the order reversed every other round). Reports the mean real length and
bucket, the milliseconds per example of each setting (median over rounds) and its speedup
against real_rows. Writes <results_dir>/setup_cost.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Sequence

from experiments import harness
from experiments.harness import Column, fmt

TASKS = {"ende": ("synthetic_ende", "demo:ende_target_big", 32),
         "cnndm": ("synthetic_cnndm", "demo:cnndm_target_big", 320)}
# setting -> (t5.SKIP_PADDING_ROWS, T5.setup_kernel_weights)
SETTINGS = {"real_rows": (True, "same"), "every_row": (False, "same"),
            "bfloat16_dot": (True, "bfloat16_dot")}
BASE = "real_rows"


def measure(args) -> tuple[list[dict[str, Any]], list[str]]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode.decoding import runner
  from spec_decode.kernels import cpu_matmul
  from spec_decode.models import t5
  settings = list(args.settings)
  notes = []
  if "bfloat16_dot" in settings and not cpu_matmul.has_bfloat16_dot():
    settings.remove("bfloat16_dot")
    notes.append(f"bfloat16_dot left out: this CPU ({cpu_matmul.cpu_info()['model']}) has "
                 "no AVX512-BF16.")
  rows = []
  for name in args.tasks:
    task, target, input_length = TASKS[name]
    models = harness.load_models(target)
    inputs = harness.task_inputs(task, split="test", num_examples=args.num_examples,
                                 input_length=input_length, decode_len=args.decode_len)
    tokens = [jnp.asarray(runner.trim_padding(inputs[i:i + 1])) for i in range(len(inputs))]
    compiled, states = {}, {}
    for setting in settings:
      skip, weights = SETTINGS[setting]
      model = dataclasses.replace(models.target, setup_kernel_weights=weights)
      params = model.decode_params(models.target_params)
      set_up = lambda p, t, model=model: model.init_cache(
          p, model.encode(p, t), args.decode_len)
      with t5.switched(SKIP_PADDING_ROWS=skip):  # compiled with this setting
        fns = {t.shape: jax.jit(set_up).lower(params, t).compile()
               for t in {t.shape: t for t in tokens}.values()}
        encode = jax.jit(model.encode)
        # the real tokens' states (the padding's are masked everywhere downstream)
        states[setting] = [np.asarray(encode(params, t).hidden)[np.asarray(t) > 0]
                           for t in tokens]
      compiled[setting] = (fns, params)
    for fns, params in compiled.values():  # warm-up
      for t in tokens:
        jax.block_until_ready(fns[t.shape](params, t))
    times: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
      for setting in (settings if r % 2 == 0 else settings[::-1]):
        fns, params = compiled[setting]
        start = time.perf_counter()
        for t in tokens:
          jax.block_until_ready(fns[t.shape](params, t))
        times[setting].append((time.perf_counter() - start) / len(tokens))
    real = (inputs > 0).sum(axis=1)
    ms = {s: 1e3 * float(np.median(times[s])) for s in settings}
    for setting in settings:
      ref = states.get(BASE)
      diff = None if ref is None else max(
          float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(states[setting], ref))
      row = {"task": task, "target": target, "setting": setting, "examples": len(tokens),
             "real_length": float(real.mean()),
             "bucket": float(np.mean([t.shape[1] for t in tokens])),
             "ms": ms[setting], "speedup": ms[BASE] / ms[setting] if BASE in ms else None,
             "state_difference": diff,
             "rounds_ms": [1e3 * x for x in times[setting]]}
      rows.append(row)
      print(f"{task}, {setting}: inputs {row['real_length']:.1f} tokens in buckets of "
            f"{row['bucket']:.1f}: set-up {ms[setting]:.2f} ms per example"
            + ("" if row["speedup"] is None else f" ({row['speedup']:.2f}X against {BASE})"),
            flush=True)
  return rows, notes


def _settings(parser: argparse.ArgumentParser, text: str) -> list[str]:
  out = [s for s in text.split(",") if s]
  unknown = [s for s in out if s not in SETTINGS]
  if unknown or not out or len(set(out)) != len(out):
    parser.error(f"--settings must name some of {sorted(SETTINGS)}, each once; got {text!r}")
  return out


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.setup_cost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default="ende,cnndm", help=f"comma list of {sorted(TASKS)}")
  p.add_argument("--settings", default="real_rows,every_row,bfloat16_dot",
                 help=f"comma list of {sorted(SETTINGS)}")
  p.add_argument("--num_examples", type=int, default=40)
  p.add_argument("--decode_len", type=int, default=48, help="cache slots of the set-up")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.tasks = [t for t in args.tasks.split(",") if t]
  unknown = [t for t in args.tasks if t not in TASKS]
  if unknown or not args.tasks:
    p.error(f"--tasks must name some of {sorted(TASKS)}, got {unknown or 'none'}")
  args.settings = _settings(p, args.settings)
  if min(args.num_examples, args.decode_len, args.rounds) < 1:
    p.error("--num_examples, --decode_len and --rounds must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows, notes = measure(args)
  cols = [Column("task", "task"), Column("target", "target"), Column("setting", "setting"),
          Column("examples", "examples"),
          Column("real_length", "mean input tokens", lambda v: fmt(v, 1)),
          Column("bucket", "mean bucket", lambda v: fmt(v, 1)),
          Column("ms", "set-up per example", lambda v: f"{v:.2f} ms"),
          Column("speedup", f"speedup against {BASE}", lambda v: fmt(v, 2, "X")),
          Column("state_difference", "encoder states: max difference / max state",
                 lambda v: "" if v is None else f"{v:.1e}")]
  notes = [f"Batch 1, each example's input trimmed to its power-of-two bucket as "
           f"`decoding.run` does; set-up = encoder + cross-attention K/V of every decoder "
           f"layer ({args.decode_len} cache slots); milliseconds per example, median over "
           f"{args.rounds} interleaved rounds, compilation excluded.",
           "real_rows: the kernel multiplies the rows up to the last real token "
           "(`t5.SKIP_PADDING_ROWS`, the default); every_row: the padding rows up to the "
           "bucket too (the same bits for the real tokens); bfloat16_dot: the set-up's "
           "weights as AVX512-BF16 dot products (`setup_kernel_weights='bfloat16_dot'`), "
           "which changes the encoder's states by the difference shown."] + notes
  return harness.Output("setup_cost", "Set-up per example under each setting", cols, rows,
                        notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.setup_cost", argv, parse_args, run)


if __name__ == "__main__":
  main()
