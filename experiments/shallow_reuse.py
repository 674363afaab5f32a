r"""Self-speculation with and without the verify call reusing the draft's first layers.

  python -m experiments.shallow_reuse                       # big EnDe target, batch 1 and 8
  python -m experiments.shallow_reuse --batch_sizes 1 --layers 4 --num_examples 8
  python -m experiments.shallow_reuse --scale tiny --num_examples 2 --repeats 1  # smoke run

`LayerSkipDrafter(layers=k)` drafts with the target's first k decoder layers. With `reuse`
(its default) the verify call takes the draft's residual streams after layer k - 1 and its
cache entries, and runs those k layers on the last proposed token only
(`T5.decode_reusing`); without, it runs all layers on all gamma + 1 positions, as for any
draft. For each batch size and depth (and the task's exit adapter, when shipped: the same
with the adapter after its k layers), on the same examples and keys, t=0:

  autoregressive                 the baseline;
  layer skip k                   reuse on;
  layer skip k, no reuse         the first k layers computed again in the verify call.

Reported: tokens per target call, the measured speedup over the baseline (median over
--repeats interleaved rounds), `reuse gain` (the no-reuse decoder's seconds / the reuse
decoder's, per round, median) and the fraction of rows identical to the baseline. The
outputs of both forms are the target's greedy outputs; what reuse changes is the verify
call's work, which on a memory-bound step (few rows, a CPU) is mostly the weights' reads
and so barely moves, and at batch more. The tiny scale (random T5 models on the offline
toy task) is for CI: seconds, the numbers mean nothing.
Writes <results_dir>/<name>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Sequence

import jax
import numpy as np

from experiments import draft_free, harness, setups
from experiments.harness import Column, fmt


def decoders(args, adapter=None):
  """{label: (Speculative, draft name or None, reuse)}: per depth and the adapter, both
  forms."""
  from spec_decode import decoding
  from spec_decode.decoding.drafters.layer_skip import LayerSkipDrafter
  spec = lambda **kw: decoding.Speculative(gamma=args.gamma, drafter=LayerSkipDrafter(**kw))
  out = {}
  for k in args.layers:
    out[f"layer skip {k}"] = (spec(layers=k), None, True)
    out[f"layer skip {k}, no reuse"] = (spec(layers=k, reuse=False), None, False)
  if adapter is not None:
    label = f"layer skip {adapter.layers} + exit adapter"
    out[label] = (spec(layers=adapter.layers, adapter=True), "adapter", True)
    out[f"{label}, no reuse"] = (spec(layers=adapter.layers, adapter=True, reuse=False),
                                 "adapter", False)
  return out


def run_task(args, task: str) -> list[dict]:
  from spec_decode import decoding
  # draft_free's loader: the big target, the task's exit adapter where shipped (the small
  # draft and a bigram table of --bigram_examples (1) come with it, unused here)
  target, tparams, drafts, inputs, decode_len = draft_free._models(args, task)
  for k in args.layers:
    if k >= target.config.num_decoder_layers:
      raise ValueError(f"--layers {k}: the {task} target has "
                       f"{target.config.num_decoder_layers} decoder layers")
  specs = decoders(args, drafts["adapter"][0] if "adapter" in drafts else None)
  common = dict(max_decode_len=decode_len, sampling=decoding.Sampling(),
                rng=jax.random.PRNGKey(args.seed))
  name = task if args.scale == "demo" else draft_free.TINY_TASK[0]
  rows = []
  for B in args.batch_sizes:
    n = len(inputs) - len(inputs) % B  # whole batches only
    if n == 0:
      raise ValueError(f"--batch_sizes {B}: more than the {len(inputs)} examples")
    batches = [(inputs[i:i + B], np.arange(i, i + B, dtype=np.int32)) for i in range(0, n, B)]
    fns = {"autoregressive": harness.decode_fn(decoding.Autoregressive(), target, tparams,
                                               **common)}
    for label, (algo, draft, _) in specs.items():
      d = drafts[draft] if draft else (None, None)
      fns[label] = harness.decode_fn(algo, target, tparams, *d, **common)
    print(f"[{task} batch {B}] compiling {len(fns)} decoders", flush=True)
    times = harness.time_decodes(
        fns, batches, repeats=args.repeats, target=target,
        on_round=lambda r: print(f"[{task} batch {B}] round {r + 1}/{args.repeats}",
                                 flush=True))
    base = times["autoregressive"]
    for label, (algo, draft, reuse) in specs.items():
      st = harness.decode_stats(times[label].outputs, n, baseline=base.outputs)
      other = times[label + ", no reuse"] if reuse else None
      rows.append({
          "task": name, "batch": B, "decoder": label, "reuse": reuse,
          "tokens_per_call": st["tokens_per_target_call"],
          "speedup": float(statistics.median(
              [a / b for a, b in zip(base.seconds, times[label].seconds)])),
          "reuse_gain": (float(statistics.median(
              [a / b for a, b in zip(other.seconds, times[label].seconds)]))
              if other else None),
          "seconds": float(statistics.median(times[label].seconds)),
          "autoregressive_seconds": float(statistics.median(base.seconds)),
          "identical_fraction": st["identical"], "examples": n})
    jax.clear_caches()
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.shallow_reuse", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", default="demo", choices=("tiny", "demo"))
  p.add_argument("--tasks", default="ende")
  p.add_argument("--batch_sizes", default="1,8")
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--layers", default=None, help="layer skip depths (default: demo 2,4 of 8 "
                 "decoder layers; tiny 1)")
  p.add_argument("--num_examples", type=int, default=16)
  p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--demo_models", default=None, help="the demo models' directory (default "
                 "demo_models/)")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--name", default=None, help="the result files' stem (default "
                 "shallow_reuse, shallow_reuse_tiny at the tiny scale)")
  args = p.parse_args(list(argv))
  args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
  bad = [t for t in args.tasks if t not in setups.TASKS]
  if bad or not args.tasks:
    p.error(f"unknown tasks {bad}; known: {setups.TASKS}")
  if args.scale == "tiny":
    args.tasks = args.tasks[:1]  # both map to the toy task
  try:
    args.batch_sizes = harness.parse_ints(args.batch_sizes, "batch_sizes")
    args.layers = harness.parse_ints(args.layers or ("2,4" if args.scale == "demo" else "1"),
                                     "layers")
  except ValueError as e:
    p.error(str(e))
  for name in ("gamma", "num_examples", "repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  args.bigram_examples = 1  # draft_free's loader fits one; unused here
  args.name = args.name or ("shallow_reuse" if args.scale == "demo" else "shallow_reuse_tiny")
  return args


def run(args, meta) -> harness.Output:
  del meta
  rows = []
  for task in args.tasks:
    rows += run_task(args, task)
  cols = [Column("task", "task"), Column("batch", "batch"), Column("decoder", "decoder"),
          Column("reuse", "reuse", lambda v: "yes" if v else "no"),
          Column("tokens_per_call", "tokens/call", lambda v: fmt(v, 2)),
          Column("speedup", "measured speedup", lambda v: fmt(v, 2, "X")),
          Column("reuse_gain", "reuse gain", lambda v: fmt(v, 3, "X")),
          Column("identical_fraction", "identical (t=0)", lambda v: fmt(v, 2))]
  notes = [f"Big demo target (45.6M, T5.1.1-small-shaped), gamma {args.gamma}, t=0, "
           f"{args.num_examples} test examples per batch size (whole batches); speedup: median "
           f"over {args.repeats} interleaved rounds of autoregressive / decoder seconds "
           "(compilation excluded, encoding included); reuse gain: the same decoder without "
           "reuse / with, per round, median."]
  if args.scale == "tiny":
    notes = ["Tiny scale: random T5 models on the offline toy task; the numbers mean nothing."]
  return harness.Output(args.name, "Self-speculation: the verify call reusing the draft's "
                        "first layers", cols, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.shallow_reuse", argv, parse_args, run)


if __name__ == "__main__":
  main()
