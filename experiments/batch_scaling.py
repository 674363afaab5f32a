r"""Speedup of speculative decoding against batch size, which the paper never measured.

  python -m experiments.batch_scaling                          # big demo EnDe pair, B = 1,4,16,64
  python -m experiments.batch_scaling --batch_sizes 1,8 --num_examples 48 --gamma auto \
      --compact_batch
  python -m experiments.batch_scaling --demo_target ende_target   # the 3.7M demo EnDe target
  python -m experiments.batch_scaling --scale tiny --batch_sizes 1,2 --num_examples 2
  python -m experiments.batch_scaling --scale paper \
      --checkpoints ende_target=gs://B/xxl_ende/ckpt,ende_small=gs://B/small_ende/ckpt

For each batch size B the same --num_examples examples are decoded in
batches of B by `spec_decode.main` (one experiment per B: baseline and
speculative, both timed after compilation); then T_p, T_q and T_verify are
measured at that B on the first batch, interleaved and inside a jitted loop
(`experiments.costs.pair_costs`, as benchmark.py), and the table lists the
measured speedup next to Theorem 3.8's prediction at the measured alpha and
c(B), and the cost model E[tokens] / (gamma c + T_verify(gamma+1) / T_p) at B.
(The run's own c, timed without interleaving, is kept in the JSON as c_run.) Larger batches make a
decode step less memory-bound, so the verify call's extra gamma tokens stop
being free (T_verify / T_p grows), and a batch waits for its slowest row.
Writes <results_dir>/batch_scaling_<demo_target>.{md,csv,json,png} at the demo scale (the
big target <task>_target_big by default), batch_scaling_<task>.* at the others.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Sequence

from experiments import harness, setups
from experiments.harness import Column, fmt

DEFAULT_RUNS_DIR = "/tmp/spec_decode_batch_scaling"


def _model_bindings(args) -> list[str]:
  """gin bindings of --refill_chunk and --kernel_weights (the target's, and the draft's when
  it is a T5)."""
  out = []
  if args.refill_chunk:
    out.append(f"ExperimentConfig.refill_chunk = {args.refill_chunk}")
  if args.kernel_weights != "auto":
    out.append(f"target/ModelSpec.kernel_weights = '{args.kernel_weights}'")
    if args.draft not in setups.NGRAM_DRAFTS:
      out.append(f"draft/ModelSpec.kernel_weights = '{args.kernel_weights}'")
  return out


def _suffix(args) -> str:
  """What tells this sweep's run directories and result files from the defaults'."""
  return (("_compact" if args.compact_batch else "")
          + (f"_refill{args.refill_chunk}" if args.refill_chunk else "")
          + ("" if args.kernel_weights == "auto" else f"_{args.kernel_weights}")
          + (f"_{args.name}" if args.name else ""))


def sweep(args) -> list[dict[str, Any]]:
  from spec_decode import theory
  rows = []
  for B in args.batch_sizes:
    s = setups.experiment_setup(args.scale, args.task, args.draft, temperature=args.temperature,
                                demo_dir=args.demo_models,
                                checkpoints=setups.parse_checkpoints(args.checkpoints),
                                demo_target=args.demo_target)
    s = s.with_bindings(*setups.row_bindings(
        gamma=args.gamma, choose_gamma=args.gamma is None,  # chosen per batch size
        temperature=args.temperature, batch_size=B, num_examples=args.num_examples,
        step_timing_repeats=args.step_timing_repeats, timing_repeats=args.timing_repeats,
        compact_batch=args.compact_batch or None), *_model_bindings(args), *args.gin_bindings)
    run_dir = os.path.join(args.runs_dir, args.scale, f"{args.demo_target or args.task}_"
                           f"{args.draft}_t{args.temperature:g}_g{args.gamma or 'auto'}_b{B}"
                           + _suffix(args))
    print(f"batch {B} -> {run_dir}", flush=True)
    summary = setups.run(s, run_dir, show_progress=args.progress)
    # gamma 0: the gamma choice fell back to the autoregressive loop (GammaChoice
    # .fallback_below); the costs and predictions below are then at its best gamma
    choice = summary.get("gamma_selection") or {}
    fell_back = choice.get("gamma") == 0
    gamma = (choice[choice["rule"]]["gamma"] if fell_back
             else summary["experiment"]["decoders"]["speculative"]["gamma"])
    pc = _costs(args, s, B, gamma)
    t = summary["timing"]
    n = summary["completed"]
    lengths = summary["mean_output_length"]
    alpha = choice["alpha"] if fell_back else summary["alpha"]
    c, r = pc["c"]["speculative"], pc["verify_ratio"][gamma + 1]
    ok = alpha is not None and not math.isnan(alpha)
    rows.append({
        "batch_size": B, "gamma": 0 if fell_back else gamma, "best_gamma": gamma,
        "fallback": choice.get("fallback"), "examples": n, "alpha": alpha,
        "warmup_speedup": (choice.get("warmup_timing") or {}).get("speedup"),
        "tokens_per_call": summary["tokens_per_target_call"], "c": c, "verify_ratio": r,
        "c_spread": pc["c_rounds"]["speculative"], "c_run": t.get("c"),
        "verify_ratio_run": t.get("verify_ratio"),
        "thm38_run": summary["speedup_predicted"],
        "target_step_ms": pc["target_step"]["median"] * 1e3,
        "draft_step_ms": pc["proposal"]["speculative"]["median"] / gamma * 1e3,
        "autoregressive_tokens_per_s": lengths["autoregressive"] * n
        / t["autoregressive_seconds"],
        "speculative_tokens_per_s": lengths["speculative"] * n / t["speculative_seconds"],
        "speedup": summary["speedup_measured"],
        "thm38": float(theory.walltime_improvement(alpha, gamma, c)) if ok else None,
        "cost_model": float(theory.expected_tokens(alpha, gamma)) / (gamma * c + r)
        if ok else None,
        "identical": summary.get("identical_fraction"), "command": s.command(run_dir)})
  return rows


def _costs(args, setup: setups.Setup, B: int, gamma: int) -> dict[str, Any]:
  """In-loop, interleaved step costs of the run's target and draft on its first batch
  (`experiment.measure.step_costs`, as every driver measures them)."""
  from spec_decode import decoding, experiment
  from spec_decode.decoding import timing
  st = setups.load(setup)
  cfg = st.config
  enc = harness.setup_batches(st)[0][0][0]
  workload = timing.Workload(target=st.target, target_params=st.target_params,
                             encoder_tokens=enc, cache_length=cfg.decode_len + gamma + 1,
                             position=cfg.decode_len // 2, draft=st.draft,
                             draft_params=st.draft_params)
  return experiment.step_costs(workload, {"speculative": decoding.Speculative(gamma=gamma)},
                               repeats=args.repeats, inner=args.inner, steps=args.loop_steps)


def plot(rows: list[dict], path: str, machine: str, command: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  b = [r["batch_size"] for r in rows]
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 4))
  ax.plot(b, [r["speedup"] for r in rows], "o-", label="measured")
  ax.plot(b, [r["thm38"] for r in rows], "s--", label="Thm 3.8 (alpha, c at B)")
  ax.plot(b, [r["cost_model"] for r in rows], "^:", label="cost model (verify at B)")
  ax.axhline(1.0, color="gray", lw=0.5)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch size")
  ax.set_ylabel("speedup over autoregressive")
  ax.legend(fontsize=7)
  ax2.plot(b, [r["c"] for r in rows], "o-", label="c = T_q / T_p")
  ax2.plot(b, [r["verify_ratio"] for r in rows], "s-", label="T_verify(gamma+1) / T_p")
  ax2.set_xscale("log", base=2)
  ax2.set_xlabel("batch size")
  ax2.legend(fontsize=7)
  fig.text(0.01, 0.005, f"{command}\n{machine}", fontsize=5, va="bottom", family="monospace")
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.batch_scaling", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", default="demo", choices=setups.SCALES)
  p.add_argument("--task", default="ende", choices=setups.TASKS)
  p.add_argument("--draft", default="small", choices=setups.DRAFTS)
  p.add_argument("--batch_sizes", default="1,4,16,64")
  p.add_argument("--gamma", default="4", help="draft tokens per call, or 'auto': chosen at "
                 "each batch size by the cost model with the verify costs measured at that "
                 "batch size (ExperimentConfig.gamma_rule)")
  p.add_argument("--compact_batch", action="store_true",
                 help="both decoders shrink their batch as rows finish (compact_batch)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--num_examples", type=int, default=None,
                 help="examples decoded at every batch size (default: the largest batch)")
  p.add_argument("--step_timing_repeats", type=int, default=None)
  p.add_argument("--repeats", type=int, default=10, help="interleaved rounds of step timing")
  p.add_argument("--inner", type=int, default=3)
  p.add_argument("--loop_steps", type=int, default=8)
  p.add_argument("--timing_repeats", type=int, default=None)
  p.add_argument("--demo_models", default=None)
  p.add_argument("--demo_target", default=None,
                 help="demo scale: the target's demo model name (default <task>_target_big, "
                      "the big demo target; <task>_target for the 3.7M one)")
  p.add_argument("--checkpoints", default=None, help="paper scale: <task>_target=PATH,"
                 "<task>_<draft>=PATH")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="extra gin bindings for every run")
  p.add_argument("--refill_chunk", type=int, default=0,
                 help="decode refill_chunk batches' worth of examples per call in batch-size "
                      "slots, each finished row's slot taken by the next example inside the "
                      "loop (ExperimentConfig.refill_chunk), both decoders")
  p.add_argument("--kernel_weights", default="auto",
                 help="how the CPU kernel stores the target's (and a T5 draft's) weights "
                      "(ModelSpec.kernel_weights), both decoders")
  p.add_argument("--name", default="", help="suffix of the result files and run directories "
                 "(runs with other --gin_bindings must not share them)")
  p.add_argument("--runs_dir", default=DEFAULT_RUNS_DIR)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--progress", action="store_true")
  p.add_argument("--no_plots", dest="plots", action="store_false")
  args = p.parse_args(list(argv))
  args.batch_sizes = harness.parse_ints(args.batch_sizes, "batch_sizes")
  args.num_examples = args.num_examples or max(args.batch_sizes)
  if args.demo_target is None and args.scale == "demo":
    args.demo_target = setups.demo_target(args.scale, args.task, "big")
  if args.gamma == "auto":
    args.gamma = None
  else:
    try:
      args.gamma = int(args.gamma)
    except ValueError:
      p.error(f"--gamma must be an int >= 1 or 'auto', got {args.gamma!r}")
    if args.gamma < 1:
      p.error("--gamma must be >= 1")
  if args.refill_chunk < 0:
    p.error(f"--refill_chunk must be >= 0, got {args.refill_chunk}")
  if args.refill_chunk and args.compact_batch:
    p.error("--refill_chunk and --compact_batch are two ways to fill finished rows' slots; "
            "choose one")
  return args


def run(args, meta) -> harness.Output:
  rows = sweep(args)
  stem = (args.demo_target or args.task) + _suffix(args)
  x = lambda v: fmt(v, 2, "X")
  cols = [Column("batch_size", "batch"), Column("gamma", "gamma"),
          Column("alpha", "alpha", lambda v: fmt(v, 3)),
          Column("tokens_per_call", "tokens/call", lambda v: fmt(v, 2)),
          Column("target_step_ms", "T_p ms", lambda v: fmt(v, 3)),
          Column("draft_step_ms", "T_q ms", lambda v: fmt(v, 3)),
          Column("c", "c", lambda v: fmt(v, 3)),
          Column("verify_ratio", "T_verify/T_p", lambda v: fmt(v, 2)),
          Column("autoregressive_tokens_per_s", "AR tokens/s", lambda v: fmt(v, 0)),
          Column("speculative_tokens_per_s", "spec tokens/s", lambda v: fmt(v, 0)),
          Column("speedup", "speedup (measured)", x), Column("thm38", "Thm 3.8", x),
          Column("cost_model", "cost model", x)]
  if args.gamma is None:
    cols.append(Column("warmup_speedup", "warm-up measured", x))
  target = f", target {args.demo_target}" if args.demo_target else ""
  gamma = (f"gamma {args.gamma}" if args.gamma else "gamma chosen at each batch size by the "
           "cost model with the verify costs measured at that batch size, and checked by "
           "timing both decoders on the warm-up examples at that gamma ('warm-up measured'; "
           "gamma 0: the costs or that timing said speculation cannot pay there, so the "
           "speculative decoder ran the autoregressive loop, and alpha, c, T_verify/T_p and "
           "the predictions are those of the best gamma it would have used, from its "
           "warm-up)")
  notes = [f"{args.scale} scale, task {args.task}{target}, draft {args.draft}, {gamma}, "
           f"temperature {args.temperature:g}, the same {args.num_examples} examples at every "
           "batch size; one spec_decode.main run per batch size (commands in the JSON rows).",
           f"T_p, T_q, c, T_verify/T_p: {args.repeats} interleaved rounds of {args.inner} calls "
           f"of {args.loop_steps} steps in one jitted loop, at that batch size (medians); "
           "Thm 3.8 and the cost model use them with the run's alpha. " + (
               f"Refill: each call decodes {args.refill_chunk} batches' worth of examples in "
               "batch-size slots, a finished row's slot taken by the next example inside the "
               "loop, in both decoders." if args.refill_chunk else
               "Rows of a batch finish at different lengths and a batch runs until its "
               "longest row is done, in both decoders" + (
                   "; both decoders shrink their batch as rows finish (compact_batch: halved "
                   "whenever at most half its rows are active)." if args.compact_batch
                   else ", computing every finished row."))]
  if args.kernel_weights != "auto":
    notes.append(f"Both decoders' models pack their CPU kernel weights as "
                 f"'{args.kernel_weights}' (ModelSpec.kernel_weights).")
  figures = []
  os.makedirs(args.results_dir, exist_ok=True)
  if args.plots:
    figures = [plot(rows, os.path.join(args.results_dir, f"batch_scaling_{stem}.png"),
                    harness.machine_line(meta["machine"], decoding=False), meta["command"])]
  return harness.Output(f"batch_scaling_{stem}", f"Batch scaling ({stem}, {args.scale} scale)",
                        cols, rows, notes, figures=figures)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.batch_scaling", argv, parse_args, run,
                      private=("results_dir", "runs_dir"))


if __name__ == "__main__":
  main()
