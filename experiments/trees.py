r"""Tree speculation (SpecExec) against the chain: tokens per target call vs budget, t(N).

  python -m experiments.trees                          # both demo tasks, t = 0 and 1
  python -m experiments.trees --scale tiny --tasks ende --budgets 4 --num_examples 2

For each task and temperature, ONE experiment (`spec_decode.main`, the demo
pair) decodes the same examples with the autoregressive baseline, the chain
(`Speculative(gamma)`, model drafter, token-level verifier) and one tree
decoder per budget B (`TreeDrafter(budget=B, width, expand, depth, steps)` +
`TreeVerifier`, SpecExec's rule), each timed after compilation. The table lists
tokens per target call, draft tokens per call, the identical fraction and the
measured speedup of each. Then t(N) = T_verify(N) / T_p, the target scoring N
new tokens in one call relative to one token, for N = 1 .. --max_tokens on
this device (in a jitted loop, `timing.step_time`), q(N) the same for the draft,
and the budget that a Sequoia-style choice makes from the draft's confidences:
  argmax_B  E(B) / (q(depth + 1) + (steps - 1) q(B) + t(B + 1)),
E(B) = 1 + the B largest node confidences per call of the largest tree run
(`theory.tree_budget_choice`); the table sets E(B) and the predicted speedup next
to the measured tokens per call and speedup of every budget run.
Writes <results_dir>/trees.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Sequence

from experiments import harness, setups
from experiments.harness import Column, fmt

DEFAULT_RUNS_DIR = "/tmp/spec_decode_trees"


def tree_shape(budget: int, width: int, depth: int) -> dict[str, int]:
  """TreeDrafter settings that can fill `budget` nodes: expand, depth, steps."""
  expand = max(2, budget // 8)
  depth = min(depth, budget)
  steps = 1 + math.ceil(max(budget - width, 0) / (expand * width))
  return {"budget": budget, "width": width, "expand": min(expand, budget),
          "depth": depth, "steps": max(2, min(steps, depth + 1))}


def decoder_bindings(gamma: int, budgets: Sequence[int], width: int,
                     depth: int) -> tuple[str, ...]:
  """gin bindings naming the chain and one tree decoder per budget."""
  out = [f"chain/Speculative.gamma = {gamma}"]
  names = [f"'chain_g{gamma}': @chain/Speculative()"]
  for b in budgets:
    shape = tree_shape(b, width, depth)
    out += [f"tree{b}/TreeDrafter.{k} = {v}" for k, v in shape.items()]
    out += [f"tree{b}/Speculative.drafter = @tree{b}/TreeDrafter()",
            f"tree{b}/Speculative.verifier = @TreeVerifier()"]
    names.append(f"'tree_b{b}': @tree{b}/Speculative()")
  out.append("ExperimentConfig.decoders = {" + ", ".join(names) + "}")
  return tuple(out)


def verify_curves(setup: setups.Setup, max_tokens: int,
                  repeats: int) -> tuple[dict[int, float], dict[int, float]]:
  """({N: T_verify(N) / T_p}, {N: T_q(N) / T_p}) for N = 1, 2, 4, .. max_tokens: the target
  and the draft scoring N new tokens in one call, in target steps, on the run's first batch."""
  import jax.numpy as jnp


  from spec_decode.decoding import timing
  st = setups.load(setup)
  cfg = st.config
  enc = harness.setup_batches(st)[0][0][0]
  sizes = sorted({1} | {2 ** k for k in range(1, max_tokens.bit_length())} | {max_tokens})
  times = {}
  for role, model, params in (("target", st.target, st.target_params),
                              ("draft", st.draft, st.draft_params)):
    # Each N at the cache size a decoder verifying N tokens allocates (decode_len + N + 1
    # slots): this implementation attends over the whole cache under a mask, so one long
    # cache for every N would inflate T_p and flatten the small-N ratios.
    times[role] = {n: timing.step_time(model, params, jnp.asarray(enc), num_tokens=n,
                                       cache_length=cfg.decode_len + n + 1,
                                       position=cfg.decode_len // 2, repeats=repeats)
                   for n in sizes}
  t_p = times["target"][1]
  return tuple({n: t / t_p for n, t in times[role].items()} for role in ("target", "draft"))


def tree_draft_cost(shape: dict[str, int], draft_curve: dict[int, float]) -> float:
  """`TreeDrafter`'s work per target call in target steps: its catch-up call of depth + 1
  tokens and steps - 1 calls scoring the whole tree (budget tokens)."""
  from spec_decode import theory
  return (theory.interpolate_cost(draft_curve, shape["depth"] + 1)
          + (shape["steps"] - 1) * theory.interpolate_cost(draft_curve, shape["budget"]))


def sweep(args):
  """(table rows, {task: (target curve, draft curve)}, {(task, t): budget choice})."""
  rows, curves, choices = [], {}, {}
  for task in args.tasks:
    for temperature in args.temperatures:
      demo_target = setups.demo_target(args.scale, task, args.demo_targets)
      s = setups.experiment_setup(args.scale, task, "small", temperature=temperature,
                                  demo_dir=args.demo_models, demo_target=demo_target)
      s = s.with_bindings(*setups.row_bindings(
          temperature=temperature, num_examples=args.num_examples,
          step_timing_repeats=args.step_timing_repeats),
          *decoder_bindings(args.gamma, args.budgets, args.width, args.depth))
      run_dir = os.path.join(args.runs_dir, args.scale,
                             f"{demo_target or task}_t{temperature:g}")
      print(f"{task} t={temperature:g} -> {run_dir}", flush=True)
      summary = setups.run(s, run_dir, show_progress=args.progress)
      if task not in curves:
        curves[task] = verify_curves(s, args.max_tokens, args.step_timing_repeats or 10)
      t = summary["timing"]
      for name, d in summary["decoders"].items():
        budget = int(name[len("tree_b"):]) if name.startswith("tree_b") else None
        draft_per_call, mass_at, calls = None, None, None
        if d.get("target_calls"):
          totals = _totals(run_dir, name)
          calls = totals["target_calls"]
          draft_per_call = totals["draft_tokens"] / totals["target_calls"]
          if "draft_mass_at" in totals:
            mass_at = [m / totals["target_calls"] for m in totals["draft_mass_at"]]
        rows.append({
            "task": task, "temperature": temperature, "decoder": name, "budget": budget,
            "steps_per_call": (t[f"{name}_seconds"] / calls / t["target_step_seconds"]
                               if calls else None),
            "tokens_per_call": d.get("tokens_per_target_call"),
            "draft_tokens_per_call": draft_per_call,
            "hit_rate": d.get("alpha_observed"),
            "identical": d.get("identical_fraction"),
            "seconds": t[f"{name}_seconds"], "speedup": d.get("speedup_measured"),
            "draft_mass_at": mass_at, "command": s.command(run_dir)})
      choices[(task, temperature)] = _choose(rows, task, temperature, *curves[task], args)
  return rows, curves, choices


def _totals(run_dir: str, name: str) -> dict[str, Any]:
  """A decoder's counters summed over the run's examples (per-position ones elementwise)."""
  import numpy as np

  from spec_decode.experiment import results
  rows = results.read_rows(os.path.join(run_dir, results.PREDICTIONS)).values()
  st = [r["decoders"][name]["stats"] for r in rows]
  out = {k: sum(x[k] for x in st) for k in ("draft_tokens", "target_calls")}
  if "draft_mass_at" in st[0]:
    out["draft_mass_at"] = np.sum([x["draft_mass_at"] for x in st], axis=0).tolist()
  return out


def _choose(rows: list[dict], task: str, temperature: float, target_curve: dict[int, float],
            draft_curve: dict[int, float], args) -> dict[str, Any] | None:
  """The budget a Sequoia-style choice makes from the draft's confidences.

  Tokens per call E(B) come from the largest-budget tree's confidences
  (`theory.tree_budget_choice`), the costs from the measured t(N) of target and
  draft; every B from the width up to the largest budget run is a candidate.
  Each tree row gets its E(B), t(B + 1) and predicted speedup.
  """
  from spec_decode import theory
  trees = [r for r in rows if r["task"] == task and r["temperature"] == temperature
           and r["budget"] is not None]
  big = max((r for r in trees if r["draft_mass_at"]), key=lambda r: r["budget"], default=None)
  if big is None:
    return None
  cost = lambda b: tree_draft_cost(tree_shape(b, args.width, args.depth), draft_curve)
  choice = theory.tree_budget_choice(big["draft_mass_at"], target_curve, cost,
                                     budgets=range(args.width, big["budget"] + 1))
  for r in trees:
    b = r["budget"]
    r["t_verify_ratio"] = theory.interpolate_cost(target_curve, b + 1)
    r["expected_tokens_conf"] = choice["expected_tokens"].get(b)
    r["predicted_speedup"] = choice["speedup"].get(b)
    r["chosen"] = b == choice["budget"]
  measured = max(trees, key=lambda r: r["speedup"] or 0.0)
  return {"budget": choice["budget"], "from_budget": big["budget"],
          "expected_tokens": choice["expected_tokens"][choice["budget"]],
          "cost": choice["cost"][choice["budget"]],
          "predicted_speedup": choice["speedup"][choice["budget"]],
          "best_measured_budget": measured["budget"], "best_measured_speedup": measured["speedup"],
          "speedup_by_budget": {str(b): v for b, v in choice["speedup"].items()}}


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.trees", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", default="demo", choices=setups.SCALES)
  p.add_argument("--tasks", default="ende,cnndm")
  setups.add_demo_targets_flag(p)
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--budgets", default="4,8,16,32")
  p.add_argument("--width", type=int, default=2)
  p.add_argument("--depth", type=int, default=8)
  p.add_argument("--gamma", type=int, default=4, help="the chain's gamma")
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--max_tokens", type=int, default=1024, help="largest N of the t(N) curves")
  p.add_argument("--step_timing_repeats", type=int, default=10)
  p.add_argument("--demo_models", default=None)
  p.add_argument("--runs_dir", default=DEFAULT_RUNS_DIR)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--progress", action="store_true")
  args = p.parse_args(list(argv))
  args.tasks = [t for t in args.tasks.split(",") if t]
  for t in args.tasks:
    if t not in setups.TASKS:
      p.error(f"unknown task {t!r}; choose from {setups.TASKS}")
  args.temperatures = harness.parse_floats(args.temperatures, "temperatures")
  args.budgets = harness.parse_ints(args.budgets, "budgets")
  if args.width < 1 or args.depth < 1 or args.gamma < 1 or args.max_tokens < 1:
    p.error("--width, --depth, --gamma and --max_tokens must be >= 1")
  if args.max_tokens < max(args.budgets) + 1:
    p.error(f"--max_tokens {args.max_tokens} must cover the largest verify call, "
            f"{max(args.budgets) + 1} tokens (the largest budget + 1)")
  return args


def run(args, meta) -> harness.Output:
  rows, curves, choices = sweep(args)
  x = lambda v: fmt(v, 2, "X")
  cols = [Column("task", "task"), Column("temperature", "t", lambda v: f"{v:g}"),
          Column("decoder", "decoder"),
          Column("tokens_per_call", "tokens/call", lambda v: fmt(v, 2)),
          Column("expected_tokens_conf", "E(B) from confidences", lambda v: fmt(v, 2)),
          Column("draft_tokens_per_call", "draft tokens/call", lambda v: fmt(v, 1)),
          Column("hit_rate", "hit rate", lambda v: fmt(v, 3)),
          Column("t_verify_ratio", "t(B+1)", lambda v: fmt(v, 2)),
          Column("predicted_speedup", "speedup (predicted)", x),
          Column("steps_per_call", "measured cost/call (steps)", lambda v: fmt(v, 1)),
          Column("chosen", "chosen B", lambda v: "<-" if v else ""),
          Column("identical", "= baseline", lambda v: fmt(v, 2)),
          Column("speedup", "speedup (measured)", x)]
  sizes = sorted(next(iter(curves.values()))[0])
  curve_md = ["", "t(N) = T_verify(N) / T_p and q(N) = T_q(N) / T_p on this device (batch 1; "
              "the target's and the draft's cost of scoring N new tokens in one call, in "
              "target steps):", "",
              "| task | model | " + " | ".join(f"N={n}" for n in sizes) + " |",
              "|---|---|" + "---|" * len(sizes)]
  for task, pair in curves.items():
    for label, curve in zip(("target t(N)", "draft q(N)"), pair):
      curve_md.append(f"| {task} | {label} | " + " | ".join(f"{curve[n]:.2f}" for n in sizes)
                      + " |")
  choice_md = ["", "Budget chosen from the draft's confidences (every B from the width to the "
               "largest budget run is a candidate):", "",
               "| task | t | chosen B | E(B) | cost (target steps) | predicted speedup | "
               "best measured B | its measured speedup |", "|---|---|---|---|---|---|---|---|"]
  for (task, temperature), c in choices.items():
    if c:
      choice_md.append(f"| {task} | {temperature:g} | {c['budget']} | "
                       f"{c['expected_tokens']:.2f} | {c['cost']:.2f} | "
                       f"{c['predicted_speedup']:.2f}X | {c['best_measured_budget']} | "
                       f"{fmt(c['best_measured_speedup'], 2, 'X')} |")
  notes = [f"{args.scale} scale, draft small, {args.num_examples} test examples per task, "
           f"batch 1; chain gamma {args.gamma}; trees width {args.width}, depth <= "
           f"{args.depth} (`experiments.trees.tree_shape` gives expand/steps per budget). One "
           "spec_decode.main run per (task, temperature): every decoder decodes the same "
           "examples (commands in the JSON rows).",
           "hit rate: the fraction of the target's draws that landed on a drafted child "
           "(the chain's: its acceptance rate).",
           "E(B) from confidences: 1 + the sum of the B largest node confidences (the draft's "
           "own path probabilities) per call, averaged over the largest-budget tree's calls "
           "(`DecodeStats.draft_mass_at`); it stands in for tokens/call before any other "
           "budget is run. speedup (predicted) = E(B) / (draft cost(B) + t(B+1)), draft "
           "cost(B) = q(depth+1) + (steps-1) q(B) (`theory.tree_budget_choice`); chosen B "
           "maximizes it. The prediction charges no loop overhead. measured cost/call: the "
           "decoder's seconds / its target calls / T_p (the run's own marginal target step); "
           "the gap to draft cost(B) + t(B+1) is the loop's own work per iteration."]
  return harness.Output(
      "trees", f"Tree speculation vs chain ({args.scale} scale)", cols, rows, notes,
      extra_md="\n".join(curve_md + choice_md) + "\n",
      extra={"verify_curve": {t: {str(n): v for n, v in c[0].items()} for t, c in curves.items()},
             "draft_curve": {t: {str(n): v for n, v in c[1].items()} for t, c in curves.items()},
             "budget_choice": {f"{t}_t{temp:g}": c for (t, temp), c in choices.items()}})


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.trees", argv, parse_args, run,
                      private=("results_dir", "runs_dir"))


if __name__ == "__main__":
  main()
