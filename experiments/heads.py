r"""Draft heads on the target's own states against the small draft model, on the demo tasks.

  python -m experiments.heads                       # the big demo targets, temperatures 0 and 1
  python -m experiments.heads --demo_targets small  # the 3.7M demo targets and their heads
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
Per decoder: alpha (sum min(p, q) / decisions), tokens per target call (and apart: each
example's first call, where a head without a learned start proposes nothing, and the later
ones), c
(the draft's work per proposed token over one target step, each timed as the
marginal cost of one more call in a jitted loop), the speedup Theorem 3.8
predicts from that alpha and c, the measured speedup over the baseline, and
the fraction of outputs identical to the baseline's (1.0 expected at
temperature 0). Writes <results_dir>/heads.{md,csv,json}.

The heads are trained on one target each. With --demo_targets big (the default) the target
is <task>_target_big and the heads are demo_models/<task>_big_<kind>, where <kind> is also
'eagle3' (an EAGLE head with EAGLE-3's multi-layer fusion); a head not shipped for a task's
big target is left out and named in the notes. The result files are heads.* with the 3.7M
targets (--demo_targets small) and heads_big.* with the big ones (--stem names others).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from typing import Any, Sequence

from experiments import harness, setups
from experiments.harness import Column, fmt


HEAD_KINDS = {"small": ("eagle", "medusa", "mtp"), "big": ("eagle", "eagle3", "medusa", "mtp")}


def head_models(task: str, targets: str) -> tuple[str, dict[str, str], list[str]]:
  """(the target's demo model, {kind: the shipped head's demo model}, the kinds not shipped
  for that target)."""
  heads, missing = {}, []
  for kind in HEAD_KINDS[targets]:
    name = f"{task}_big_{kind}" if targets == "big" else f"{task}_{kind}"
    if os.path.isdir(os.path.join(harness.DEMO_DIR, name)):
      heads[kind] = name
    else:
      missing.append(kind)
  return setups.DEMO_TARGETS[targets].format(task=task), heads, missing


def run_task(task: str, temperature: float, args) -> list[dict[str, Any]]:
  import jax
  from spec_decode import decoding, experiment, theory
  from spec_decode.decoding import timing
  task_name, input_length, decode_len = setups.DEMO_TASKS[task]
  # The 3.7M targets decode in float32 as their heads were measured; the big ones as their
  # main job does (the checkpoint's bfloat16 weights read by the CPU kernel).
  target_dtype = "float32" if args.demo_targets == "small" else None
  target_name, head_names, _ = head_models(task, args.demo_targets)
  demo = lambda name, dtype="float32": harness.model_spec(f"demo:{name}", dtype=dtype)
  models = harness.load_models(demo(target_name, target_dtype), {
      "small": demo(f"{task}_small", target_dtype),
      **{kind: demo(name) for kind, name in head_names.items()}})
  inputs = harness.task_inputs(task_name, split=args.split, num_examples=args.num_examples,
                               input_length=input_length, decode_len=decode_len)
  batches, n = harness.batches(inputs, 1)
  sampling = decoding.Sampling(temperature=temperature)
  g = args.gamma
  decoders = {  # name: (algorithm, the draft it reads)
      "autoregressive": (decoding.Autoregressive(), None),
      f"small draft (gamma {g})": (decoding.Speculative(gamma=g), "small")}
  if "eagle" in head_names:
    decoders[f"EAGLE head (gamma {g})"] = (
        decoding.Speculative(gamma=g, drafter=decoding.EagleDrafter()), "eagle")
  if "eagle3" in head_names:
    layers = models.draft("eagle3")[0].config.fuse_layers
    decoders[f"EAGLE-3 fused head, layers {list(layers)} + final (gamma {g})"] = (
        decoding.Speculative(gamma=g, drafter=decoding.EagleDrafter()), "eagle3")
  if "medusa" in head_names:
    gamma = min(g, models.draft("medusa")[0].num_heads)
    decoders[f"Medusa heads (gamma {gamma})"] = (
        decoding.Speculative(gamma=gamma, drafter=decoding.MedusaDrafter()), "medusa")
  if "mtp" in head_names:
    mtp_gamma = min(g, models.draft("mtp")[0].num_modules)
    decoders[f"MTP modules (gamma {mtp_gamma})"] = (
        decoding.Speculative(gamma=mtp_gamma, drafter=decoding.MtpDrafter()), "mtp")
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
    row = {"task": setups.TASK_LABELS[task], "target": target_name,
           "temperature": temperature, "decoder": name,
           "tokens_per_second": st["tokens"] / med, "speedup": base_s / med,
           "tokens_per_target_call": st["tokens_per_target_call"],
           "identical": st["identical"]}
    if algo.drafter is not None:
      row.update(first_call=st.get("tokens_first_call"),
                 later_calls=st.get("tokens_per_later_call"))
      alpha, c = st["alpha"], costs["c"][name]
      row.update(alpha=alpha, c=c, gamma=algo.gamma,
                 thm38=(float(theory.walltime_improvement(alpha, algo.gamma, c))
                        if not math.isnan(alpha) else None))
    rows.append(row)
  print(harness.markdown_table(_columns(), rows), flush=True)
  return rows


def _columns():
  return [Column("task", "task", str), Column("target", "target", str),
          Column("temperature", "t", lambda v: fmt(v, 1)),
          Column("decoder", "decoder", str), Column("alpha", "alpha"),
          Column("tokens_per_target_call", "tokens per target call", lambda v: fmt(v, 2)),
          Column("first_call", "first call", lambda v: fmt(v, 2)),
          Column("later_calls", "later calls", lambda v: fmt(v, 2)),
          Column("c", "c"), Column("thm38", "Thm 3.8", lambda v: fmt(v, 2, "X")),
          Column("speedup", "measured speedup", lambda v: fmt(v, 2, "X")),
          Column("tokens_per_second", "tokens/s", lambda v: fmt(v, 1)),
          Column("identical", "identical to AR", lambda v: fmt(v, 2))]


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.heads", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default="ende,cnndm")
  setups.add_demo_targets_flag(p)
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--split", default="test")
  p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
  p.add_argument("--timing_repeats", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--stem", default=None, help="result file names (default: heads_big with "
                 "the big demo targets, heads with the 3.7M ones)")
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
  notes = []
  for task in args.tasks:
    target, _, missing = head_models(task, args.demo_targets)
    if missing:
      notes.append(f"{task}: no {', '.join(missing)} head is shipped for {target}; left out.")
  if args.demo_targets == "big":
    notes.append("The big targets (T5.1.1-small-shaped, 45.6M) and the small draft decode "
                 "with the checkpoints' bfloat16 weights (read by the CPU kernel, float32 "
                 "arithmetic), as the main job does; so do the EAGLE heads' layer, fc and fuse "
                 "kernels (`EagleHead.decode_params`) and each MTP module's layer and fc "
                 "kernels (`MtpModules.decode_params`), the rest of each head in float32.")
  notes += [f"{args.num_examples} {args.split} examples per task, batch 1, {args.repeats} "
           "interleaved rounds (median); speedup = baseline seconds / decoder seconds.",
           "c: each decoder's proposal (its drafter's own propose in a jitted loop: the small "
           "draft's gamma steps, the EAGLE head's chain, the Medusa heads' one call, the MTP "
           "modules' gamma windows) divided by gamma, over one target step; marginal costs "
           "in interleaved rounds (`experiment.measure.step_costs`). MTP's first call of each "
           "example proposes nothing (no target feature yet), nor does an EAGLE head's "
           "without a learned start (`EagleConfig.start_feature`: one predicts f_0 from the "
           "encoder output, so its first call drafts too); EAGLE's commit "
           "feeds the verified positions through the head, which c does not count (MTP's "
           "commit runs no module).",
           "Thm 3.8 = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) at the measured alpha "
           "and c (it assumes a verify call costs one target step)."]
  stem = args.stem or ("heads_big" if args.demo_targets == "big" else "heads")
  return harness.Output(stem, "Draft heads (EAGLE, Medusa, MTP) against the small draft model",
                        _columns(), rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.heads", argv, parse_args, run)


if __name__ == "__main__":
  main()
