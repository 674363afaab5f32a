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
import statistics
from typing import Any, Sequence

from experiments import harness, setups
from experiments.harness import Column, fmt


def run_task(task: str, temperature: float, args) -> list[dict[str, Any]]:
  import jax
  from spec_decode import decoding, experiment, theory
  from spec_decode.decoding import timing
  task_name, input_length, decode_len = setups.DEMO_TASKS[task]
  demo = lambda name: harness.model_spec(f"demo:{name}", dtype="float32")
  models = harness.load_models(demo(f"{task}_target"), {
      kind: demo(f"{task}_{kind}") for kind in ("small", "eagle", "medusa", "mtp")})
  gamma = min(args.gamma, models.draft("medusa")[0].num_heads)
  mtp_gamma = min(args.gamma, models.draft("mtp")[0].num_modules)
  inputs = harness.task_inputs(task_name, split=args.split, num_examples=args.num_examples,
                               input_length=input_length, decode_len=decode_len)
  batches, n = harness.batches(inputs, 1)
  sampling = decoding.Sampling(temperature=temperature)
  decoders = {  # name: (algorithm, the draft it reads)
      "autoregressive": (decoding.Autoregressive(), None),
      f"small draft (gamma {args.gamma})": (decoding.Speculative(gamma=args.gamma), "small"),
      f"EAGLE head (gamma {args.gamma})": (
          decoding.Speculative(gamma=args.gamma, drafter=decoding.EagleDrafter()), "eagle"),
      f"Medusa heads (gamma {gamma})": (
          decoding.Speculative(gamma=gamma, drafter=decoding.MedusaDrafter()), "medusa"),
      f"MTP modules (gamma {mtp_gamma})": (
          decoding.Speculative(gamma=mtp_gamma, drafter=decoding.MtpDrafter()), "mtp")}
  common = dict(max_decode_len=decode_len, sampling=sampling, rng=jax.random.PRNGKey(args.seed))
  fns = {name: harness.decode_fn(algo, models.target, models.target_params,
                                 *(models.draft(d) if d else ()), **common)
         for name, (algo, d) in decoders.items()}
  times = harness.time_decodes(fns, batches, repeats=args.repeats, target=models.target)
  workload = timing.Workload(target=models.target, target_params=models.target_params,
                             encoder_tokens=batches[0][0], cache_length=decode_len + 8,
                             position=decode_len // 2, sampling=sampling)
  costs = experiment.step_costs(
      workload, {name: algo for name, (algo, _) in decoders.items()},
      drafts={name: models.draft(d) for name, (_, d) in decoders.items() if d},
      repeats=args.timing_repeats)
  base = times["autoregressive"]
  base_s = statistics.median(base.seconds)
  rows = []
  for name, (algo, _) in decoders.items():
    t = times[name]
    st = harness.decode_stats(t.outputs, n, baseline=base.outputs)
    med = statistics.median(t.seconds)
    row = {"task": setups.TASK_LABELS[task], "temperature": temperature, "decoder": name,
           "tokens_per_second": st["tokens"] / med, "speedup": base_s / med,
           "tokens_per_target_call": st["tokens_per_target_call"],
           "identical": st["identical"]}
    if algo.drafter is not None:
      alpha, c = st["alpha"], costs["c"][name]
      row.update(alpha=alpha, c=c, gamma=algo.gamma,
                 thm38=(float(theory.walltime_improvement(alpha, algo.gamma, c))
                        if not math.isnan(alpha) else None))
    rows.append(row)
  print(harness.markdown_table(_columns(), rows), flush=True)
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
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.tasks = [t for t in args.tasks.split(",") if t]
  unknown = set(args.tasks) - set(setups.DEMO_TASKS)
  if unknown or not args.tasks:
    p.error(f"--tasks must name demo tasks among {sorted(setups.DEMO_TASKS)}, got {args.tasks}")
  args.temperatures = harness.parse_floats(args.temperatures, "temperatures")
  for name in ("gamma", "num_examples", "repeats", "timing_repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows = [r for task in args.tasks for t in args.temperatures for r in run_task(task, t, args)]
  notes = [f"{args.num_examples} {args.split} examples per task, batch 1, {args.repeats} "
           "interleaved rounds (median); speedup = baseline seconds / decoder seconds.",
           "c: each decoder's proposal (its drafter's own propose in a jitted loop: the small "
           "draft's gamma steps, the EAGLE head's chain, the Medusa heads' one call, the MTP "
           "modules' gamma windows) divided by gamma, over one target step; marginal costs "
           "in interleaved rounds (`experiment.measure.step_costs`). EAGLE's and MTP's first "
           "call of each example proposes nothing (no target feature yet); EAGLE's commit "
           "feeds the verified positions through the head, which c does not count (MTP's "
           "commit runs no module).",
           "Thm 3.8 = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) at the measured alpha "
           "and c (it assumes a verify call costs one target step)."]
  return harness.Output("heads", "Draft heads (EAGLE, Medusa, MTP) against the small draft model",
                        _columns(), rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.heads", argv, parse_args, run)


if __name__ == "__main__":
  main()
