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
this device (in a jitted loop, `timing.step_time`), and the budget that a
Sequoia-style choice makes from these measurements:
  argmax_B  tokens_per_call(B) / (draft seconds per call(B) / T_p + t(B + 1)),
with the draft's seconds per call taken from the run (tree decode time minus
the target's share is not separable here, so the measured speedup is the
final word; the choice is reported next to it).
Writes <results_dir>/trees.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Sequence

from experiments import _common, setups
from experiments._common import Column, fmt

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


def verify_curve(setup: setups.Setup, max_tokens: int, repeats: int) -> dict[int, float]:
  """{N: T_verify(N) / T_p} for N = 1, 2, 4, .. max_tokens on the run's first batch."""
  import jax.numpy as jnp

  from spec_decode import batching, timing
  st = setups.load(setup)
  cfg = st.config
  enc, _ = batching.example_batch(list(st.examples[:cfg.batch_size]),
                                  batch_size=cfg.batch_size,
                                  input_length=cfg.feature_lengths["inputs"])
  sizes = sorted({1} | {2 ** k for k in range(1, max_tokens.bit_length())} | {max_tokens})
  length = cfg.decode_len + max(sizes) + 1
  times = {n: timing.step_time(st.target, st.target_params, jnp.asarray(enc), num_tokens=n,
                               cache_length=length, position=cfg.decode_len // 2,
                               repeats=repeats) for n in sizes}
  return {n: t / times[1] for n, t in times.items()}


def run(args) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]]]:
  rows, curves = [], {}
  for task in args.tasks:
    for temperature in args.temperatures:
      s = setups.experiment_setup(args.scale, task, "small", temperature=temperature,
                                  demo_dir=args.demo_models)
      s = s.with_bindings(*setups.row_bindings(
          gamma=args.gamma, temperature=temperature, num_examples=args.num_examples,
          step_timing_repeats=args.step_timing_repeats),
          *decoder_bindings(args.gamma, args.budgets, args.width, args.depth))
      run_dir = os.path.join(args.runs_dir, args.scale, f"{task}_t{temperature:g}")
      print(f"{task} t={temperature:g} -> {run_dir}", flush=True)
      summary = setups.run(s, run_dir, show_progress=args.progress)
      if task not in curves:
        curves[task] = verify_curve(s, args.max_tokens, args.step_timing_repeats or 10)
      t = summary["timing"]
      for name, d in summary["decoders"].items():
        budget = int(name[len("tree_b"):]) if name.startswith("tree_b") else None
        draft_per_call = None
        if d.get("target_calls"):
          totals = _totals(run_dir, name)
          draft_per_call = totals["draft_tokens"] / totals["target_calls"]
        rows.append({
            "task": task, "temperature": temperature, "decoder": name, "budget": budget,
            "tokens_per_call": d.get("tokens_per_target_call"),
            "draft_tokens_per_call": draft_per_call,
            "hit_rate": d.get("alpha_observed"),
            "identical": d.get("identical_fraction"),
            "seconds": t[f"{name}_seconds"], "speedup": d.get("speedup_measured"),
            "command": s.command(run_dir)})
      _choose(rows, task, temperature, curves[task], t)
  return rows, curves


def _totals(run_dir: str, name: str) -> dict[str, int]:
  from spec_decode import results
  rows = results.read_rows(os.path.join(run_dir, results.PREDICTIONS)).values()
  st = [r["decoders"][name]["stats"] for r in rows]
  return {k: sum(x[k] for x in st) for k in ("draft_tokens", "target_calls")}


def _choose(rows: list[dict], task: str, temperature: float, curve: dict[int, float],
            timing: dict) -> None:
  """Marks the budget the measured tokens/call and t(N) favour (Sequoia-style)."""
  trees = [r for r in rows if r["task"] == task and r["temperature"] == temperature
           and r["budget"] is not None]
  sizes = sorted(curve)
  for r in trees:
    n = r["budget"] + 1
    above = [k for k in sizes if k >= n]
    ratio = curve[above[0]] if above else curve[sizes[-1]]
    r["t_verify_ratio"] = ratio
    r["predicted_rate"] = r["tokens_per_call"] / ratio if r["tokens_per_call"] else None
  best = max((r for r in trees if r["predicted_rate"]), key=lambda r: r["predicted_rate"],
             default=None)
  for r in trees:
    r["chosen"] = r is best


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.trees", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", default="demo", choices=setups.SCALES)
  p.add_argument("--tasks", default="ende,cnndm")
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--budgets", default="4,8,16,32")
  p.add_argument("--width", type=int, default=2)
  p.add_argument("--depth", type=int, default=8)
  p.add_argument("--gamma", type=int, default=4, help="the chain's gamma")
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--max_tokens", type=int, default=64, help="largest N of the t(N) curve")
  p.add_argument("--step_timing_repeats", type=int, default=10)
  p.add_argument("--demo_models", default=None)
  p.add_argument("--runs_dir", default=DEFAULT_RUNS_DIR)
  p.add_argument("--results_dir", default=_common.RESULTS_DIR)
  p.add_argument("--progress", action="store_true")
  args = p.parse_args(list(argv))
  args.tasks = [t for t in args.tasks.split(",") if t]
  for t in args.tasks:
    if t not in setups.TASKS:
      p.error(f"unknown task {t!r}; choose from {setups.TASKS}")
  args.temperatures = _common.parse_floats(args.temperatures, "temperatures")
  args.budgets = _common.parse_ints(args.budgets, "budgets")
  if args.width < 1 or args.depth < 1 or args.gamma < 1 or args.max_tokens < 1:
    p.error("--width, --depth, --gamma and --max_tokens must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  meta = _common.new_meta("experiments.trees", argv, **{
      k: v for k, v in vars(args).items() if k not in ("results_dir", "runs_dir")})
  rows, curves = run(args)
  _common.finish_meta(meta)
  x = lambda v: fmt(v, 2, "X")
  cols = [Column("task", "task"), Column("temperature", "t", lambda v: f"{v:g}"),
          Column("decoder", "decoder"),
          Column("tokens_per_call", "tokens/call", lambda v: fmt(v, 2)),
          Column("draft_tokens_per_call", "draft tokens/call", lambda v: fmt(v, 1)),
          Column("hit_rate", "hit rate", lambda v: fmt(v, 3)),
          Column("t_verify_ratio", "t(B+1)", lambda v: fmt(v, 2)),
          Column("chosen", "chosen B", lambda v: "<-" if v else ""),
          Column("identical", "= baseline", lambda v: fmt(v, 2)),
          Column("speedup", "speedup (measured)", x)]
  curve_md = ["", "t(N) = T_verify(N) / T_p on this device (target, batch 1):", "",
              "| task | " + " | ".join(f"N={n}" for n in sorted(next(iter(curves.values()))))
              + " |", "|---|" + "---|" * len(next(iter(curves.values())))]
  for task, curve in curves.items():
    curve_md.append(f"| {task} | " + " | ".join(f"{curve[n]:.2f}" for n in sorted(curve))
                    + " |")
  notes = [f"{args.scale} scale, draft small, {args.num_examples} test examples per task, "
           f"batch 1; chain gamma {args.gamma}; trees width {args.width}, depth <= "
           f"{args.depth} (`experiments.trees.tree_shape` gives expand/steps per budget). One "
           "spec_decode.main run per (task, temperature): every decoder decodes the same "
           "examples (commands in the JSON rows).",
           "hit rate: the fraction of the target's draws that landed on a drafted child "
           "(the chain's: its acceptance rate). chosen B: the budget maximizing "
           "tokens/call / t(B+1) (a Sequoia-style choice from measured values; it ignores "
           "the draft's cost, which the measured speedup includes)."]
  paths = _common.write_outputs(args.results_dir, "trees",
                                title=f"Tree speculation vs chain ({args.scale} scale)",
                                columns=cols, rows=rows, meta=meta, notes=notes,
                                extra_md="\n".join(curve_md) + "\n",
                                extra={"verify_curve": {t: {str(n): v for n, v in c.items()}
                                                        for t, c in curves.items()}})
  print(open(paths["md"], encoding="utf-8").read())
  return paths


if __name__ == "__main__":
  main()
