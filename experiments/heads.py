r"""Draft heads on the target's own states against the small draft model, on the demo tasks.

  python -m experiments.heads                       # both demo tasks, temperatures 0 and 1
  python -m experiments.heads --tasks ende --temperatures 0 --num_examples 4

For each task and temperature, in one process and on the same examples
(batch 1, up to the task's output length), each decoder decodes every example
once per round, rounds interleaved (median over rounds): the autoregressive
baseline, the chain with the small draft model (`Speculative(gamma)`, model
drafter), the chain from the task's shipped EAGLE head
(`Speculative(gamma, drafter=EagleDrafter())`, demo_models/<task>_eagle), from
its Medusa heads (`Speculative(gamma, drafter=MedusaDrafter())`,
demo_models/<task>_medusa) and from its DeepSeek-V3-style MTP modules
(`Speculative(gamma, drafter=MtpDrafter())`, demo_models/<task>_mtp).
Per decoder: alpha (sum min(p, q) / decisions), tokens per target call, c
(the draft's work per proposed token over one target step, each timed as the
marginal cost of one more call in a jitted loop), the speedup Theorem 3.8
predicts from that alpha and c, the measured speedup over the baseline, and
the fraction of outputs identical to the baseline's (1.0 expected at
temperature 0). Writes <results_dir>/heads.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from experiments import _common, setups
from experiments._common import Column, fmt


def run_task(task: str, temperature: float, args) -> list[dict[str, Any]]:
  import jax
  from spec_decode import data, decoding, metrics, theory
  import spec_decode.heads  # noqa: F401  (registers the head kinds)
  from spec_decode.checkpoints import heads as head_checkpoints
  from spec_decode.model_specs import LoadContext, ModelSpec, load
  task_name, input_length, decode_len = setups.DEMO_TASKS[task]
  demo = lambda name: ModelSpec(checkpoint=os.path.join(setups.DEMO_DIR, name), dtype="float32")
  target, tparams = load(demo(f"{task}_target"), LoadContext("target"))
  draft, dparams = load(demo(f"{task}_small"), LoadContext("draft"))
  heads, hparams = head_checkpoints.load(os.path.join(setups.DEMO_DIR, f"{task}_medusa"))
  eagle_head, eagle_params = head_checkpoints.load(
      os.path.join(setups.DEMO_DIR, f"{task}_eagle"))
  modules, mparams = head_checkpoints.load(os.path.join(setups.DEMO_DIR, f"{task}_mtp"))
  gamma = min(args.gamma, heads.num_heads)
  mtp_gamma = min(args.gamma, modules.num_modules)
  examples = data.load_examples(data.get_task(task_name), split=args.split,
                                num_examples=args.num_examples,
                                feature_lengths={"inputs": input_length, "targets": decode_len})
  encs = [data.encoder_batch([ex], batch_size=1, input_length=input_length) for ex in examples]
  sampling = decoding.Sampling(temperature=temperature)
  decoders = {
      "autoregressive": (decoding.Autoregressive(), None, None),
      f"small draft (gamma {args.gamma})": (decoding.Speculative(gamma=args.gamma), draft,
                                            dparams),
      f"EAGLE head (gamma {args.gamma})": (
          decoding.Speculative(gamma=args.gamma, drafter=decoding.EagleDrafter()), eagle_head,
          eagle_params),
      f"Medusa heads (gamma {gamma})": (
          decoding.Speculative(gamma=gamma, drafter=decoding.MedusaDrafter()), heads, hparams),
      f"MTP modules (gamma {mtp_gamma})": (
          decoding.Speculative(gamma=mtp_gamma, drafter=decoding.MtpDrafter()), modules,
          mparams)}

  def decode(algo, d, dp, enc, row):
    kw = dict(draft=d, draft_params=dp) if algo.needs_draft else {}
    r = decoding.run(algo, target, tparams, enc, max_decode_len=decode_len, sampling=sampling,
                     rng=jax.random.PRNGKey(args.seed), row_ids=np.array([row], np.int32), **kw)
    jax.block_until_ready(r.tokens)
    return r

  for algo, d, dp in decoders.values():  # compile
    decode(algo, d, dp, encs[0], 0)
  seconds = {n: [] for n in decoders}
  last: dict[str, list] = {}
  for _ in range(args.repeats):
    for n, (algo, d, dp) in decoders.items():
      t0 = time.perf_counter()
      last[n] = [decode(algo, d, dp, enc, i) for i, enc in enumerate(encs)]
      seconds[n].append(time.perf_counter() - t0)
  from spec_decode import experiment
  from spec_decode.decoding import timing
  workload = timing.Workload(target=target, target_params=tparams, encoder_tokens=encs[0],
                             cache_length=decode_len + 8, position=decode_len // 2,
                             sampling=sampling)
  costs = experiment.step_costs(
      workload, {n: algo for n, (algo, _, _) in decoders.items()},
      drafts={n: (d, dp) for n, (_, d, dp) in decoders.items() if d is not None},
      repeats=args.timing_repeats)
  base_tokens = [tuple(np.asarray(r.tokens)[0, :int(r.lengths[0])]) for r in
                 last["autoregressive"]]
  base_s = statistics.median(seconds["autoregressive"])
  rows = []
  for n, (algo, _, _) in decoders.items():
    res = last[n]
    total = lambda key: float(sum(np.asarray(getattr(r.stats, key)).sum() for r in res))
    tokens = float(sum(int(r.lengths[0]) for r in res))
    med = statistics.median(seconds[n])
    row = {"task": setups.TASK_LABELS[task], "temperature": temperature, "decoder": n,
           "tokens_per_second": tokens / med, "speedup": base_s / med,
           "tokens_per_target_call": tokens / total("target_calls"),
           "identical": float(np.mean([tuple(np.asarray(r.tokens)[0, :int(r.lengths[0])]) == b
                                       for r, b in zip(res, base_tokens)]))}
    if algo.needs_draft:
      alpha = metrics.alpha_estimate(min_pq_sum=total("min_pq_sum"),
                                     decisions=total("decisions"))
      c = costs["c"][n]["median"]
      row.update(alpha=alpha, c=c, gamma=algo.gamma,
                 thm38=(float(theory.walltime_improvement(alpha, algo.gamma, c))
                        if not math.isnan(alpha) else None))
    rows.append(row)
  print(_common.markdown_table(_columns(), rows), flush=True)
  return rows


def _columns():
  return [Column("task", "task", str), Column("temperature", "t", lambda v: fmt(v, 1)),
          Column("decoder", "decoder", str), Column("alpha", "alpha"),
          Column("tokens_per_target_call", "tokens per target call", lambda v: fmt(v, 2)),
          Column("c", "c"), Column("thm38", "Thm 3.8", lambda v: fmt(v, 2, "X")),
          Column("speedup", "measured speedup", lambda v: fmt(v, 2, "X")),
          Column("tokens_per_second", "tokens/s", lambda v: fmt(v, 1)),
          Column("identical", "identical to AR", lambda v: fmt(v, 2))]


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.heads", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default="ende,cnndm")
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--split", default="test")
  p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
  p.add_argument("--timing_repeats", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--results_dir", default=_common.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.tasks = [t for t in args.tasks.split(",") if t]
  unknown = set(args.tasks) - set(setups.DEMO_TASKS)
  if unknown or not args.tasks:
    p.error(f"--tasks must name demo tasks among {sorted(setups.DEMO_TASKS)}, got {args.tasks}")
  args.temperatures = _common.parse_floats(args.temperatures, "temperatures")
  for name in ("gamma", "num_examples", "repeats", "timing_repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  meta = _common.new_meta("experiments.heads", argv, **{
      k: v for k, v in vars(args).items() if k != "results_dir"})
  rows = [r for task in args.tasks for t in args.temperatures for r in run_task(task, t, args)]
  _common.finish_meta(meta)
  notes = [f"{args.num_examples} {args.split} examples per task, batch 1, {args.repeats} "
           "interleaved rounds (median); speedup = baseline seconds / decoder seconds.",
           "c: the small draft's step, the EAGLE head's drafting step, or the Medusa proposal "
           "(all heads, one call) or the MTP proposal (gamma modules, each on a 2 gamma "
           "window) divided by gamma, over one target step; marginal costs in jitted loops. "
           "EAGLE's and MTP's first call of each example proposes nothing (no target feature "
           "yet); EAGLE's commit feeds the verified positions through the head, which c does "
           "not count (MTP's commit runs no module).",
           "Thm 3.8 = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) at the measured alpha "
           "and c (it assumes a verify call costs one target step)."]
  paths = _common.write_outputs(args.results_dir, "heads",
                                title="Draft heads (EAGLE, Medusa, MTP) against the small draft model",
                                columns=_columns(), rows=rows, meta=meta, notes=notes)
  print(open(paths["md"], encoding="utf-8").read())
  return paths


if __name__ == "__main__":
  main()
