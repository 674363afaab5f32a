r"""gamma and c sweeps of speculative decoding, measured against Theorem 3.8.

  python -m experiments.ablate                       # big demo EnDe target; drafts small/base/3.7M
  python -m experiments.ablate --demo_targets small  # the 3.7M demo target; drafts small/base/large
  python -m experiments.ablate --added_c 0.25,0.5,1,2 --delay_mode sleep
  python -m experiments.ablate --scale tiny --gammas 1-3 --added_c 1 --num_examples 2

Draft variants: the drafts of --drafts as they are (their natural c), and the
--delay_draft wrapped in `spec_decode.models.delayed.DelayedDecoder` once per
--added_c value x, its delay calibrated so that each draft call costs about
x * T_p more (c ~ c0 + x); alpha stays that of the undelayed draft. For each
variant and each gamma in --gammas, speculative decoding of the same
--num_examples examples is timed against the autoregressive baseline (all
after compilation, --repeats speculative passes, each paired with a baseline pass just
before it, the median ratio kept), next to
  Thm 3.8:    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), at the
              variant's measured alpha and c; and
  cost model: E[tokens] / (gamma c + T_verify(gamma+1) / T_p), which charges
              the measured cost of verifying gamma + 1 tokens instead of one step
              (made non-decreasing in gamma, as a run's choice of gamma does).
With the big demo targets each decode call takes 10 examples in the refill loop
(--refill_chunk, both decoders), as their main jobs decode.
Writes <results_dir>/ablate_<task>.{md,csv,json} (ablate_<task>_3.7m.* with --demo_targets
small) and three PNG plots:
  ablate_<task>_gamma.png    speedup vs gamma per variant, points over both curves;
  ablate_<task>_c.png        speedup vs c for the delayed variants, per gamma;
  ablate_<task>_figure3.png  the paper's Figure 3 (optimal gamma vs alpha, one curve
                             per c) with each variant's best measured gamma.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, Sequence

import jax
import numpy as np

from experiments import harness, setups
from experiments.harness import Column, fmt
from spec_decode.decoding import timing
from spec_decode.experiment import release_executables_if_crowded
from spec_decode.models.delayed import DelayedDecoder


@dataclasses.dataclass(frozen=True)
class Variant:
  """A draft to sweep: its label, model and params; added = the requested extra c (or None)."""
  label: str
  draft: str
  model: Any
  params: Any
  added: float | None = None
  delay: float | None = None


def _load(args) -> tuple[Any, dict[str, Any], list[str]]:
  """(first loaded setup, {draft: setup}, notes about drafts that are missing)."""
  loaded, notes = {}, []
  extra = setups.row_bindings(temperature=args.temperature, num_examples=args.num_examples,
                              batch_size=args.batch_size, refill_chunk=args.refill_chunk or None)
  names = list(dict.fromkeys(list(args.drafts) + ([args.delay_draft] if args.added_c else [])))
  for d in names:
    demo_target = setups.demo_target(args.scale, args.task, args.demo_targets)
    s = setups.experiment_setup(args.scale, args.task, d, temperature=args.temperature,
                                demo_dir=args.demo_models,
                                demo_target=demo_target).with_bindings(*extra)
    if s.missing:
      notes.append(f"draft {d} skipped: {'; '.join(s.missing)}")
      continue
    loaded[d] = setups.load(s)
  if not loaded:
    raise ValueError(f"no draft could be loaded: {notes}")
  return next(iter(loaded.values())), loaded, notes


def _calibrate(args, draft, dparams, enc, cache_length: int, t_p: float) -> dict:
  """Delay per --added_c value: seconds (sleep) or matmul iterations (compute)."""
  model = DelayedDecoder(draft, mode=args.delay_mode, matmul_size=args.matmul_size)
  if args.delay_mode == "sleep":
    return {x: x * t_p for x in args.added_c}
  probe = 8
  step = lambda d: timing.decode_loop(model, model.wrap_params(dparams, d), enc, num_tokens=1,
                                     cache_length=cache_length, steps=args.loop_steps)
  while True:  # grow the probe until it adds at least T_p / 2 (well above timing noise)
    t = timing.interleaved({"0": step(0), "p": step(probe)}, repeats=max(3, args.repeats),
                           inner=args.inner)
    extra = float(np.median(t["p"]) - np.median(t["0"]))
    if extra > 0.5 * t_p or probe >= 1 << 20:
      break
    probe *= 16
  per_iteration = max(extra, 1e-9) / probe
  return {x: float(max(1, round(x * t_p / per_iteration))) for x in args.added_c}


def sweep(args) -> dict[str, Any]:
  from spec_decode import decoding, experiment, theory
  base, loaded, notes = _load(args)
  cfg = base.config
  target, tparams = base.target, base.target_params
  batches, n = harness.setup_batches(base, per_call=True)
  variants = [Variant(f"{d} (natural)" if args.added_c else d, d, s.draft, s.draft_params)
              for d, s in loaded.items() if d in args.drafts]
  cache_length = cfg.decode_len + max(args.gammas) + 1
  enc = batches[0][0][:cfg.batch_size]  # one batch of slots
  workload = timing.Workload(target=target, target_params=tparams, encoder_tokens=enc,
                             cache_length=cache_length, position=cfg.decode_len // 2)
  # Every step cost is the marginal cost of one more decode in a jitted loop (loops of
  # k = --loop_steps and 2k decodes: `decoding.timing`); a k-decode call divided by k would
  # charge each step a share of the call's fixed cost (for the 3.7M demo target 0.385 ms
  # per step against 0.13 ms marginal), pulling c and T_verify / T_p towards 1.
  costs = lambda decoders, drafts, verify, repeats: experiment.step_costs(
      workload, decoders, drafts=drafts, verify_tokens=verify, repeats=repeats,
      inner=args.inner, steps=args.loop_steps)
  t_p0 = costs({}, {}, (), max(3, args.repeats))["target_step"]["median"]
  if args.added_c and args.delay_draft in loaded:
    d = loaded[args.delay_draft]
    delays = _calibrate(args, d.draft, d.draft_params, enc, cache_length, t_p0)
    model = DelayedDecoder(d.draft, mode=args.delay_mode, matmul_size=args.matmul_size)
    unit = "s" if args.delay_mode == "sleep" else " matmuls"
    for x, delay in delays.items():
      variants.append(Variant(f"{args.delay_draft} +{x:g} T_p ({delay:.4g}{unit})",
                              args.delay_draft, model, model.wrap_params(d.draft_params, delay),
                              added=x, delay=delay))
  # Step costs, interleaved: T_p, each variant's T_q (a one-token proposal), the verify calls.
  step = costs({f"draft_{i}": decoding.Speculative(gamma=1) for i in range(len(variants))},
               {f"draft_{i}": (v.model, v.params) for i, v in enumerate(variants)},
               [g + 1 for g in args.gammas], args.repeats)
  c = [step["c"][f"draft_{i}"] for i in range(len(variants))]
  verify = {g: step["verify_ratio"][g + 1] for g in args.gammas}
  # The cost model charges the verify costs made non-decreasing in N, as the runs' own
  # choice of gamma does (experiment.gamma.choose_gamma): a dip in the measured curve is
  # timing noise, not a cheaper call.
  fitted = theory.nondecreasing_costs({g + 1: verify[g] for g in args.gammas})  # {N: t(N)}
  t_p = step["target_step"]["median"]
  # End-to-end decoding. Each speculative pass is paired with an autoregressive pass just
  # before it (`harness.time_decodes` rounds): this machine's speed drifts by tens of
  # percent over the minutes a sweep takes, so one baseline pass per round would bias the
  # later variants' ratios. One variant and gamma at a time, all its rounds together: a
  # sweep's ~70 compiled loops would not fit in the process's memory maps at once (see
  # experiment.release_executables_if_crowded).
  common = dict(max_decode_len=cfg.decode_len, sampling=cfg.sampling,
                rng=jax.random.PRNGKey(cfg.seed))
  if cfg.refill_chunk:
    common["refill_batch"] = cfg.batch_size
  ar = harness.decode_fn(decoding.Autoregressive(), target, tparams, **common)
  rows = []
  for i, v in enumerate(variants):
    for g in args.gammas:
      spec = harness.decode_fn(decoding.Speculative(gamma=g), target, tparams, v.model,
                               v.params, **common)
      t = harness.time_decodes({"autoregressive": ar, "speculative": spec}, batches,
                               repeats=args.repeats)
      release_executables_if_crowded()
      st = harness.decode_stats(t["speculative"].outputs, n)
      speedups = [a / b for a, b in zip(t["autoregressive"].seconds, t["speculative"].seconds)]
      a, cm = st["alpha"], c[i]
      ok = not math.isnan(a)
      rows.append({
          "variant": v.label, "draft": v.draft, "added_c": v.added, "delay": v.delay,
          "c": cm, "c_spread": step["c_rounds"][f"draft_{i}"], "gamma": g, "alpha": a,
          "alpha_observed": st["alpha_observed"],
          "tokens_per_call": st["tokens_per_target_call"], "verify_ratio": verify[g],
          "verify_ratio_fitted": fitted[g + 1],
          "autoregressive_seconds": float(np.median(t["autoregressive"].seconds)),
          "speculative_seconds": float(np.median(t["speculative"].seconds)),
          "speedup": float(np.median(speedups)), "speedup_spread": harness.spread(speedups),
          "thm38": float(theory.walltime_improvement(a, g, cm)) if ok else None,
          "cost_model": float(theory.cost_model_improvement(a, g, cm, fitted))
          if ok else None,
          "tokens": st["tokens"], "target_calls": st["target_calls"],
          "setup_model": harness.setup_charged_speedup(
              ar_seconds=float(np.median(t["autoregressive"].seconds)), tokens=st["tokens"],
              target_calls=st["target_calls"], target_step=t_p,
              iteration_steps=g * cm + fitted[g + 1])})
  for v_rows in _by_variant(rows).values():
    best = max(v_rows, key=lambda r: r["speedup"])
    a = _mean_alpha(v_rows)
    # The cost model's choice as a run makes it: one alpha for the draft, the fitted costs.
    cost_gamma = None if math.isnan(a) else max(v_rows, key=lambda r: float(
        theory.cost_model_improvement(a, r["gamma"], r["c"], fitted)))["gamma"]
    # How far the measured curve lies from the predicted one (cost model + set-up).
    off = [r["speedup"] / r["setup_model"] - 1.0 for r in v_rows if r["setup_model"]]
    worst = max(off, key=abs) if off else None
    for r in v_rows:
      r["setup_model_deviation"] = (r["speedup"] / r["setup_model"] - 1.0
                                    if r["setup_model"] else None)
      r["worst_setup_model_deviation"] = worst
      r["best_measured_gamma"] = best["gamma"]
      r["optimal_gamma_cost_model"] = cost_gamma
      r["variant_alpha"] = a
      r["optimal_gamma_thm38"] = None if math.isnan(a) else int(
          theory.optimal_gamma(a, r["c"], max_gamma=max(args.gammas)))
  return {"rows": rows, "notes": notes, "target_step": step["target_step"],
          "target": cfg.target.label, "task": cfg.task, "examples": n,
          "batch_size": cfg.batch_size, "temperature": cfg.sampling.temperature,
          "decode_len": cfg.decode_len}


def _mean_alpha(rows: list[dict]) -> float:
  """A variant's alpha: the mean over its gammas (each run measures it on its own decisions)."""
  values = [r["alpha"] for r in rows if not math.isnan(r["alpha"])]
  return float(np.mean(values)) if values else math.nan


def _by_variant(rows: list[dict]) -> dict[str, list[dict]]:
  out: dict[str, list[dict]] = {}
  for r in rows:
    out.setdefault(r["variant"], []).append(r)
  return out


# ------------------------------------------------------------------ plots
def plot(res: dict[str, Any], stem: str, machine: str, command: str) -> list[str]:
  """The three PNGs (see the module docstring); returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  from spec_decode import theory
  by = _by_variant(res["rows"])
  footer = f"{command}\n{machine}"
  paths = []
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

  def save(fig, name):
    fig.text(0.01, 0.005, footer, fontsize=5, va="bottom", family="monospace", wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = f"{stem}_{name}.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    paths.append(path)

  # 1. speedup vs gamma.
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for k, (label, rows) in enumerate(by.items()):
    col = colors[k % len(colors)]
    g = np.array([r["gamma"] for r in rows])
    s = np.array([r["speedup"] for r in rows])
    lo = s - np.array([r["speedup_spread"]["p25"] for r in rows])
    hi = np.array([r["speedup_spread"]["p75"] for r in rows]) - s
    a = rows[0]["variant_alpha"]
    ax.errorbar(g, s, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], fmt="o", color=col,
                label=f"{label}: alpha {a:.2f}, c {rows[0]['c']:.2f}")
    if not math.isnan(a):
      gg = np.arange(1, max(g) + 1)
      ax.plot(gg, theory.walltime_improvement(a, gg, rows[0]["c"]), "-", color=col, alpha=0.7)
      ax.plot(g, [r["cost_model"] for r in rows], ":", color=col, alpha=0.9)
      ax.plot(g, [r["setup_model"] for r in rows], "--", color=col, alpha=0.6, lw=0.8)
  ax.axhline(1.0, color="gray", lw=0.5)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("gamma")
  ax.set_ylabel("speedup over autoregressive")
  ax.set_title("Measured (points) vs Thm 3.8 (solid), cost model (dotted) and cost model + "
               "set-up (dashed)", fontsize=8)
  ax.legend(fontsize=6)
  save(fig, "gamma")

  # 2. speedup vs c (delayed variants and natural ones), a curve per gamma.
  fig, ax = plt.subplots(figsize=(7, 4.5))
  gammas = sorted({r["gamma"] for r in res["rows"]})
  shown = [g for g in gammas if g in (1, 2, 3, 5, 7, 10)] or gammas
  delayed = [r for r in res["rows"] if r["added_c"] is not None]
  # The delayed draft at its natural c and with each delay: one alpha, c varied.
  pool = [r for r in res["rows"] if r["draft"] == delayed[0]["draft"]] if delayed \
      else res["rows"]
  alpha = _mean_alpha(pool)
  cmax = max(r["c"] for r in pool) * 1.1
  cc = np.linspace(0.0, max(cmax, 0.1), 100)
  for k, g in enumerate(shown):
    col = colors[k % len(colors)]
    pts = [r for r in pool if r["gamma"] == g]
    ax.plot([r["c"] for r in pts], [r["speedup"] for r in pts], "o", color=col,
            label=f"gamma {g}")
    if not math.isnan(alpha):
      ax.plot(cc, theory.walltime_improvement(alpha, g, cc), "-", color=col, alpha=0.7)
  ax.axhline(1.0, color="gray", lw=0.5)
  ax.set_xlabel("c = T_q / T_p (measured)")
  ax.set_ylabel("speedup over autoregressive")
  ax.set_title(f"c sweep: measured (points) vs Thm 3.8 at alpha = {alpha:.2f} (lines)")
  ax.legend(fontsize=6)
  save(fig, "c")

  # 3. Figure 3: optimal gamma vs alpha, one curve per measured c.
  fig, ax = plt.subplots(figsize=(7, 4.5))
  aa = np.linspace(0.05, 0.99, 200)
  gmax = max(gammas)
  optimum = lambda c: np.where(theory.speculation_helps(aa, c),  # alpha <= c: none helps
                               theory.optimal_gamma(aa, c, max_gamma=gmax), np.nan)
  for c in (0.02, 0.04, 0.11):  # the paper's T5-small/base/large drafts of T5-XXL
    ax.step(aa, optimum(c), where="mid", color="gray", ls="--", lw=0.8, alpha=0.6)
  ax.plot([], [], color="gray", ls="--", lw=0.8, label="paper's c = 0.02, 0.04, 0.11")
  for k, (label, rows) in enumerate(by.items()):
    col = colors[k % len(colors)]
    cm, a = rows[0]["c"], rows[0]["variant_alpha"]
    ax.step(aa, optimum(cm), where="mid", color=col, alpha=0.6,
            label=f"Thm 3.8 optimum, c = {cm:.2f} ({label})")
    if not math.isnan(a):
      ax.plot([a], [rows[0]["best_measured_gamma"]], "o", color=col, ms=8)
  ax.set_xlim(0.0, 1.0)
  ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("alpha")
  ax.set_ylabel("optimal gamma (curves drawn where alpha > c)")
  ax.set_title("Optimal gamma vs alpha (paper Fig. 3); points: best measured gamma")
  ax.legend(fontsize=6)
  save(fig, "figure3")
  return paths


# ------------------------------------------------------------------ main
def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.ablate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", default="demo", choices=("tiny", "demo"))
  p.add_argument("--task", default="ende", choices=setups.TASKS)
  setups.add_demo_targets_flag(p, "the target is")
  p.add_argument("--drafts", default=None,
                 help=f"drafts swept at their natural c, among {setups.DRAFTS} (default: "
                 "small,base,target with the big demo target: the paper's size ratios; else "
                 "small,base,large)")
  p.add_argument("--delay_draft", default="small", help="the draft the c sweep delays")
  p.add_argument("--added_c", default="0.25,0.5,1,2",
                 help="extra cost per draft call in units of T_p ('' = no c sweep)")
  p.add_argument("--delay_mode", default="compute", choices=("compute", "sleep"))
  p.add_argument("--matmul_size", type=int, default=64,
                 help="compute mode: side of the square matmuls (smaller = finer steps of c)")
  p.add_argument("--gammas", default="1-10")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--num_examples", type=int, default=None, help="default: tiny 2, demo 40")
  p.add_argument("--batch_size", type=int, default=1)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--inner", type=int, default=3)
  p.add_argument("--loop_steps", type=int, default=8,
                 help="k: step costs are marginal, from jitted loops of k and 2k decodes "
                 "(see costs.py)")
  setups.add_refill_chunk_flag(p)
  p.add_argument("--demo_models", default=None)
  p.add_argument("--no_plots", dest="plots", action="store_false")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  if args.drafts is None:
    big = args.scale == "demo" and args.demo_targets == "big"
    args.drafts = "small,base,target" if big else "small,base,large"
  args.drafts = tuple(d.strip() for d in args.drafts.split(",") if d.strip())
  bad = [d for d in args.drafts + (args.delay_draft,) if d not in setups.DRAFTS]
  if bad:
    p.error(f"unknown drafts {bad}; known: {setups.DRAFTS}")
  args.added_c = harness.parse_floats(args.added_c, "added_c") if args.added_c.strip() else ()
  if any(x <= 0 for x in args.added_c):
    p.error("--added_c values must be > 0")
  args.gammas = harness.parse_ints(args.gammas, "gammas")
  args.num_examples = args.num_examples or (2 if args.scale == "tiny" else 40)
  args.refill_chunk = setups.refill_chunk_of(p, args)
  return args


def run(args, meta) -> harness.Output:
  res = sweep(args)
  x = lambda v: fmt(v, 2, "X")
  pct = lambda v: "n/a" if v is None else f"{100 * v:+.0f}%"
  cols = [Column("variant", "draft"), Column("c", "c", lambda v: fmt(v, 3)),
          Column("gamma", "gamma"), Column("alpha", "alpha", lambda v: fmt(v, 3)),
          Column("tokens_per_call", "tokens/call", lambda v: fmt(v, 2)),
          Column("verify_ratio", "T_verify/T_p", lambda v: fmt(v, 2)),
          Column("verify_ratio_fitted", "fitted", lambda v: fmt(v, 2)),
          Column("speedup", "speedup (measured)", x), Column("thm38", "Thm 3.8", x),
          Column("cost_model", "cost model", x),
          Column("setup_model", "cost model + set-up", x),
          Column("setup_model_deviation", "measured / (cost model + set-up) - 1", pct),
          Column("best_measured_gamma", "best gamma (measured)"),
          Column("optimal_gamma_cost_model", "best gamma (cost model)"),
          Column("optimal_gamma_thm38", "optimal gamma (Thm 3.8)")]
  notes = [f"target {res['target']} on {res['task']}, {res['examples']} examples, batch "
           f"{res['batch_size']}, temperature {res['temperature']:g}, up to {res['decode_len']} "
           f"tokens; T_p = {harness.fmt_spread(res['target_step'], scale=1e3)} ms.",
           f"Delay mode {args.delay_mode}: " + (
               f"a chain of [{args.matmul_size}, {args.matmul_size}] matmuls per draft call"
               if args.delay_mode == "compute" else "a host-callback sleep per draft call")
           + " (spec_decode/models/delayed.py); the delay is calibrated to add about x * T_p "
           "per call.",
           f"Speedups: median over {args.repeats} passes of autoregressive / speculative seconds "
           "on the same examples, each speculative pass timed right after its own baseline "
           "pass (the machine's speed drifts); c and T_verify/T_p are ratios of the medians of "
           "marginal step costs over interleaved rounds: (t(2k) - t(k)) / k for jitted loops "
           f"of k = {args.loop_steps} and 2k decodes (no per-step dispatch, no call's fixed "
           "cost; experiment.measure.step_costs).",
           "cost model: at the row's alpha, charging T_verify/T_p made non-decreasing in "
           "gamma (fitted: least squares, as a run's own choice of gamma fits them); best "
           "gamma (cost model): its best gamma of the grid at the draft's alpha (the mean "
           "over its rows), as a run chooses.",
           ("Each decode call takes " + f"{args.refill_chunk} batches' worth of examples in "
            "the refill loop, both decoders (as the big main jobs decode)."
            if args.refill_chunk else "One decode call per batch."),
           "cost model + set-up: the cost model charging what both decoders pay once per "
           "example (encoding, cross-attention caches, each call's fixed cost: the "
           "autoregressive seconds less tokens x T_p) and the target calls the speculative "
           "decoder made (a sequence ending inside a block wastes its rest)."] + \
      res["notes"]
  name = f"ablate_{args.task}" + ("_3.7m" if args.scale == "demo" and
                                  args.demo_targets == "small" else "")
  stem = os.path.join(args.results_dir, name)
  os.makedirs(args.results_dir, exist_ok=True)
  figures = []
  if args.plots:
    figures = plot(res, stem, harness.machine_line(meta["machine"], decoding=False), meta["command"])
  summary_cols = [
      Column("variant", "draft"), Column("c", "c", lambda v: fmt(v, 3)),
      Column("variant_alpha", "alpha", lambda v: fmt(v, 3)),
      Column("best_measured_gamma", "best gamma (measured)"),
      Column("speedup", "speedup at it", x), Column("thm38", "Thm 3.8 there", x),
      Column("cost_model", "cost model there", x),
      Column("setup_model", "cost model + set-up there", x),
      Column("optimal_gamma_cost_model", "best gamma (cost model)"),
      Column("optimal_gamma_thm38", "optimal gamma (Thm 3.8)"),
      Column("speedup_at_optimal", "measured at Thm 3.8's gamma", x),
      Column("worst_setup_model_deviation", "worst gap to cost model + set-up", pct)]
  summary_rows = []
  for v_rows in _by_variant(res["rows"]).values():
    best = next(r for r in v_rows if r["gamma"] == r["best_measured_gamma"])
    at_opt = next((r for r in v_rows if r["gamma"] == r["optimal_gamma_thm38"]), None)
    summary_rows.append(dict(best, speedup_at_optimal=at_opt and at_opt["speedup"]))
  return harness.Output(name,
                        f"Ablation: gamma and c sweeps ({args.task}, {args.scale} scale)", cols,
                        res["rows"], notes, readme_table=(summary_cols, summary_rows),
                        figures=figures)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.ablate", argv, parse_args, run)


if __name__ == "__main__":
  main()
