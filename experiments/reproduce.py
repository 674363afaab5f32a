r"""Reproduces the paper's Tables 1-5 and writes them next to the paper's numbers.

  python -m experiments.reproduce --table 2                 # demo scale, the big demo targets
  python -m experiments.reproduce --table 2 --demo_targets small   # the 3.7M demo targets
  python -m experiments.reproduce --table 1,2,3,4,5 --scale tiny   # seconds; CI smoke run
  python -m experiments.reproduce --table 2,4 --scale paper \
      --checkpoints ende_target=gs://B/xxl_ende/checkpoint_N,ende_small=gs://B/small_ende/... \
      --gin_bindings "ExperimentConfig.mesh = 'data=1,model=8'"

Tables:
  1  Theorem 3.8 / 3.11 at c = c_hat = 0 for the paper's (alpha, gamma) pairs,
     plus a Monte Carlo simulation of i.i.d. acceptance; no models.
  2  speedup and alpha of T5 drafts for the T5 target, per task/temperature/gamma.
  3  alpha of unigram, bigram and T5 drafts at t = 0 and t = 1 (speculative runs
     only, gamma as in the paper's configs).
  4  Table 2's runs with the measured c and Theorem 3.8's prediction.
  5  alpha under lenience l = 1, 0.5, 0.3, 0.1 (EnDe, t = 1).
At the demo scale the targets are the big demo targets (T5.1.1-small-shaped, 45.6M) by
default, and the paper's drafts map to demo models of about the paper's size ratios: T5-small
(1/144 of T5-XXL) -> demo small (1/104), T5-base (1/45) -> demo base (1/56), T5-large (1/14)
-> the 3.7M demo target (1/12); Table 3 adds the demo large (1/24) and the small draft
distilled from the 3.7M target and from the big target (DistillSpec).
gamma: by default the speculative runs of Tables 2 and 4 at the demo scale choose their gamma
from warm-up measurements (`GammaChoice`, as the main job does) and the table shows it next
to the paper's; --gamma paper runs the paper's gamma. With --demo_targets small (the 3.7M
targets, where a CPU step is bound by launching kernels) the drafts are the demo small, base
and large, at the paper's gamma.
With the big demo targets each run decodes its examples 10 per call in the refill loop
(--refill_chunk, both decoders), as their main jobs do; --refill_chunk 0: one call each.
Every model row is one `spec_decode.main` experiment (see experiments/setups.py
for what each scale runs); rows shared between tables run once. Run
directories go to --runs_dir (resumable: a rerun reuses finished examples), the
tables to --results_dir as table_N.md / .csv / .json, each with the command,
machine and date, and the exact `spec_decode.main` command of every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import traceback
from typing import Any, Sequence

import numpy as np

from experiments import harness, paper_tables, setups
from experiments.harness import Column, fmt

TABLES = (1, 2, 3, 4, 5)
DEFAULT_RUNS_DIR = "/tmp/spec_decode_reproduce"
DRAFT_LABELS = {"small": "T5-small", "base": "T5-base", "large": "T5-large",
                "unigram": "unigram", "bigram": "bigram",
                "small_distilled": "T5-small distilled (ours; not in the paper)",
                "small_distilled_big": "T5-small distilled from this target (ours; DistillSpec)"}
# The demo model standing in for each paper draft of a big demo target, by size ratio.
BIG_TARGET_DRAFTS = {"small": "small", "base": "base", "large": "target"}
GAMMA_RULES = ("paper", "auto")


@dataclasses.dataclass(frozen=True)
class Job:
  """One experiment run: a name for its directory and its gin setup."""
  name: str
  setup: setups.Setup

  @property
  def key(self) -> str:
    # NUM_EXAMPLES is left out: a rerun with more examples extends the same run.
    b = [x for x in self.setup.bindings if not x.startswith("NUM_EXAMPLES")]
    text = json.dumps([self.setup.gin_files, b])
    return f"{self.name}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


@dataclasses.dataclass(frozen=True)
class Row:
  """A table row: its id (for --rows), fixed cells, and the jobs behind its measured cells."""
  id: str
  cells: dict
  jobs: dict


def _big(args) -> bool:
  return args.scale == "demo" and args.demo_targets == "big"


def _ours(args, draft: str) -> str:
  """The draft that stands in for the paper's `draft` (see the module doc)."""
  return BIG_TARGET_DRAFTS.get(draft, draft) if _big(args) else draft


def _setup(args, task: str, draft: str, *, temperature: float, **row) -> setups.Setup:
  s = setups.experiment_setup(args.scale, task, draft, temperature=temperature,
                              demo_dir=args.demo_models,
                              demo_target=setups.demo_target(args.scale, task, args.demo_targets),
                              checkpoints=setups.parse_checkpoints(args.checkpoints))
  extra = setups.row_bindings(temperature=float(temperature), num_examples=args.num_examples,
                              step_timing_repeats=args.step_timing_repeats,
                              timing_repeats=args.timing_repeats,
                              refill_chunk=args.refill_chunk or None, **row)
  return s.with_bindings(*extra, *args.gin_bindings)


def _job(args, task, draft, temperature, gamma, *, lenience=None, baseline=True) -> Job:
  """The run of `draft` (already mapped by `_ours`) at `gamma` (None: chosen by the run)."""
  name = f"{task}_{draft}_t{temperature:g}_g{'auto' if gamma is None else gamma}" + \
      (f"_l{lenience:g}" if lenience is not None else "") + ("" if baseline else "_alpha")
  examples = args.num_examples
  if examples is None and args.scale == "demo":
    examples = 50 if baseline else 100
  s = _setup(dataclasses.replace(args, num_examples=examples), task, draft,
             temperature=temperature, gamma=gamma, choose_gamma=gamma is None,
             lenience=lenience, run_baseline=None if baseline else False)
  return Job(name, s)


def plan(table: int, args) -> list[Row]:
  """The rows of `table` and the jobs their measured cells come from."""
  rows = []
  if table == 1:
    for alpha, gamma, ops, speed in paper_tables.TABLE1:
      rows.append(Row(f"{alpha:g}_{gamma}", dict(alpha=alpha, gamma=gamma, paper_operations=ops,
                                                 paper_speed=speed), {}))
  elif table in (2, 4):
    for task, draft, t, g, alpha, c, pred, speed in paper_tables.TABLE4:
      cells = dict(task=setups.TASK_LABELS[task], draft=DRAFT_LABELS[draft], temp=t, gamma=g,
                   paper_alpha=alpha, paper_speed=speed, paper_c=c, paper_predicted=pred)
      run_gamma = None if args.gamma == "auto" else g
      rows.append(Row(f"{task}_{draft}_t{t}", cells,
                      {"run": _job(args, task, _ours(args, draft), t, run_gamma)}))
  elif table == 3:
    # Each task's distilled small draft (DistillSpec-style) follows its paper rows; with the
    # big targets the demo large (1/24 of them, between the paper's base and large) and the
    # small draft distilled from the big target itself too.
    table3 = []
    extra = ("large_demo", "small_distilled", "small_distilled_big") if _big(args) else \
        ("small_distilled",)
    for row in paper_tables.TABLE3:
      table3.append(row)
      if row[1] is not None and row[2] == "large":
        table3 += [(row[0], row[1], d, None, None) for d in extra]
    for target, task, draft, a0, a1 in table3:
      label = "demo large (ours; not in the paper)" if draft == "large_demo" else \
          DRAFT_LABELS.get(draft, draft)
      cells = dict(target=target, draft=label, paper_t0=a0, paper_t1=a1)
      jobs = {}
      if task is not None:
        paper_draft = {"small_distilled": "small", "small_distilled_big": "small",
                       "large_demo": "large"}.get(draft, draft)
        ours = "large" if draft == "large_demo" else _ours(args, draft)
        jobs = {f"t{t}": _job(args, task, ours, t,
                              paper_tables.paper_gamma(task, paper_draft, t), baseline=False)
                for t in (0, 1)}
      rows.append(Row(f"{task or target}_{draft}", cells, jobs))
  elif table == 5:
    for draft, alphas in paper_tables.TABLE5:
      cells = {"draft": DRAFT_LABELS[draft]}
      jobs = {}
      for l, a in zip(paper_tables.LENIENCES, alphas):
        cells[f"paper_l{l:g}"] = a
        jobs[f"l{l:g}"] = _job(args, "ende", _ours(args, draft), 1,
                               paper_tables.paper_gamma("ende", draft, 1),
                               lenience=None if l == 1.0 else l, baseline=False)
      rows.append(Row(draft, cells, jobs))
  else:
    raise ValueError(f"--table must be among {TABLES}, got {table}")
  return rows


# ------------------------------------------------------------------ running
def run_jobs(jobs: dict[str, Job], args) -> dict[str, dict[str, Any]]:
  """Runs each distinct job once: {job key: {'summary', 'dir', 'command'} or {'error'}}."""
  out = {}
  for n, (key, job) in enumerate(sorted(jobs.items()), 1):
    run_dir = os.path.join(args.runs_dir, args.scale, key)
    entry: dict[str, Any] = {"dir": run_dir, "command": job.setup.command(run_dir)}
    if job.setup.missing:
      entry["error"] = "; ".join(job.setup.missing)
    else:
      print(f"[{n}/{len(jobs)}] {job.name} -> {run_dir}", flush=True)
      try:
        entry["summary"] = setups.run(job.setup, run_dir, show_progress=args.progress)
        entry["decoded"] = _decoded_at(run_dir)
      except Exception as e:  # noqa: BLE001 - reported in the table; --fail_fast re-raises
        if args.fail_fast:
          raise
        traceback.print_exc()
        entry["error"] = f"{type(e).__name__}: {e}"
    out[key] = entry
  return out


# ------------------------------------------------------------------ tables
def _simulate(alpha: float, gamma: int, steps: int = 200_000, seed: int = 0) -> float:
  """Mean tokens per step with i.i.d. Bernoulli(alpha) acceptances (Monte Carlo)."""
  rng = np.random.default_rng(seed)
  accept = rng.random((steps, gamma)) < alpha
  return float(np.mean(np.cumprod(accept, axis=1).sum(axis=1) + 1))


def _measured(entry: dict | None, key: str):
  if entry is None or "summary" not in entry:
    return None
  value = entry["summary"]
  for part in key.split("."):
    value = value.get(part) if isinstance(value, dict) else None
  return value


def _note(row: Row, results: dict) -> str:
  notes = []
  for cell, job in row.jobs.items():
    entry = results.get(job.key)
    if entry is None:
      notes.append(f"{cell}: not run (--rows)")
    elif "error" in entry:
      notes.append(f"{cell}: {entry['error']}")
  return "; ".join(dict.fromkeys(notes)) if notes else ""


def render(table: int, rows: list[Row], results: dict) -> tuple[list[Column], list[dict], list]:
  """Columns, row dicts and notes of `table` from the rows' job results."""
  from spec_decode import theory
  out, notes = [], []
  get = lambda row, cell, key: _measured(results.get(row.jobs[cell].key), key) \
      if cell in row.jobs else None
  x = lambda v: fmt(v, 2, "X")
  a2 = lambda v: fmt(v, 2)
  if table == 1:
    cols = [Column("alpha", "alpha", a2), Column("gamma", "gamma"),
            Column("paper_operations", "operations (paper)", x),
            Column("operations", "operations (Thm 3.11)", x),
            Column("sim_operations", "operations (simulated)", x),
            Column("paper_speed", "speed (paper)", x),
            Column("speed", "speed (Thm 3.8)", x), Column("sim_speed", "speed (simulated)", x)]
    for row in rows:
      a, g = row.cells["alpha"], row.cells["gamma"]
      tokens = _simulate(a, g)
      out.append(dict(row.cells, operations=float(theory.operations_factor(a, g, 0.0)),
                      speed=float(theory.walltime_improvement(a, g, 0.0)),
                      sim_speed=tokens, sim_operations=(g + 1) / tokens))
    notes = ["c = c_hat = 0. Theorems evaluated with spec_decode.theory; 'simulated' counts "
             "tokens per target call over 200,000 simulated steps with i.i.d. "
             "Bernoulli(alpha) acceptances (seed 0): speed = E[tokens per call], operations = "
             "(gamma + 1) / E[tokens per call]."]
    return cols, out, notes
  if table in (2, 4):
    cols = [Column("task", "task"), Column("draft", "draft (paper)"),
            Column("target_ours", "target / draft (ours)"), Column("temp", "temp"),
            Column("gamma", "gamma (paper)"), Column("gamma_ours", "gamma (ours)"),
            Column("paper_alpha", "alpha (paper)", a2), Column("alpha", "alpha (ours)", a2)]
    if table == 4:
      cols += [Column("paper_c", "c (paper)", a2), Column("c", "c (ours)", lambda v: fmt(v, 3)),
               Column("c_in_loop", "c in the loop (ours)", lambda v: fmt(v, 3)),
               Column("paper_predicted", "predicted (paper)", lambda v: fmt(v, 1, "X")),
               Column("predicted", "predicted (ours)", x),
               Column("verify_ratio", "T_verify/T_p (ours)", a2),
               Column("cost_model", "cost model (ours)", x),
               Column("setup_fraction", "set-up / AR time (ours)", a2),
               Column("setup_model", "cost model + set-up (ours)", x),
               Column("setup_efficiency", "measured / that", a2)]
    cols += [Column("paper_speed", "speed (paper)", lambda v: fmt(v, 1, "X")),
             Column("speed", "speed (ours)", x)]
    if table == 2:
      cols += [Column("identical", "= baseline", lambda v: fmt(v, 2)),
               Column("tokens_per_call", "tokens/call", a2)]
    cols += [Column("examples", "examples"), Column("note", "note")]
    for row in rows:
      labels = [get(row, "run", f"experiment.{r}.name") for r in ("target", "draft")]
      # The run's own gamma: the paper's, or the one its warm-up chose (0: it fell back to
      # the autoregressive loop).
      g = get(row, "run", "experiment.decoders.speculative.gamma")
      alpha, c, r = (get(row, "run", k) for k in ("alpha", "timing.c", "timing.verify_ratio"))
      c_loop = get(row, "run", "timing.c_in_loop")
      run_costs = dict(c_run=c, c_in_loop=c_loop, verify_ratio_run=r,
                       predicted_run=get(row, "run", "speedup_predicted"))
      charged = c_loop if c_loop is not None else c  # what the run's gamma choice charged
      predicted = cost = None
      if None not in (g, alpha, charged, r) and g > 0 and not np.isnan(alpha):
        predicted = float(theory.walltime_improvement(alpha, g, charged))
        cost = float(theory.expected_tokens(alpha, g)) / (g * charged + r)
      setup = _setup_charged(results.get(row.jobs["run"].key), g, charged)
      note = _note(row, results)
      if setup.get("setup_fraction", 0.0) > 1.0:  # two clocks that disagree: say so
        flag = (f"set-up timed alone {setup['setup_fraction']:.2f}x the autoregressive time "
                "per example (a separately timed call, noise or its dispatch: not this run's "
                "split)")
        note = f"{note}; {flag}" if note else flag
      out.append(dict(row.cells, gamma_ours=g, alpha=alpha, cost_model=cost, **run_costs,
                      **setup,
                      alpha_observed=get(row, "run", "alpha_observed"),
                      c=c, predicted=predicted, verify_ratio=r,
                      speed=get(row, "run", "speedup_measured"),
                      identical=get(row, "run", "identical_fraction"),
                      tokens_per_call=get(row, "run", "tokens_per_target_call"),
                      examples=get(row, "run", "completed"),
                      target_ours=" / ".join(l for l in labels if l) or None,
                      note=note))
    notes = ["alpha (ours) = mean over decided draft positions of sum_x min(p, q) (the paper's "
             "definition, on the speculative output, which is distributed as the target's); "
             "speed = autoregressive seconds / speculative seconds on the same examples, "
             "batch as configured, both timed after compilation in one process.",
             "gamma (ours): the gamma the run decoded with: the paper's, or (--gamma auto) the "
             "one the run chose from its warm-up measurements (`GammaChoice`: the cost model "
             "at the measured alpha, c and verify costs, then checked by timing both "
             "decoders on the warm-up examples; 0 means it fell back to the autoregressive "
             "loop)."]
    if table == 4:
      notes.append(
          "c (ours) and T_verify/T_p (ours): the run's own, measured as every driver measures "
          "them (`experiment.measure.step_costs`: the marginal cost of one more single-token "
          "or (gamma+1)-token call in a jitted loop, target and draft timed in the same "
          "interleaved rounds, c the ratio of the medians) on its first batch."
          " c in the loop (ours): each proposal timed right after a verify call, where the "
          "decoding loop runs it (the draft's weights read again after the target's went "
          "through the caches; `GammaChoice.in_loop_costs`, set by the demo run configs); "
          "the runs' gamma choices charge it, and so do predicted, cost model and cost model "
          "+ set-up where a run measured it."
          " predicted = Thm 3.8 at the measured alpha and c and gamma (ours); cost model = "
          "E[tokens](alpha, "
          "gamma) / (gamma c + T_verify(gamma+1) / T_p): Thm 3.8 charging the measured cost "
          "of the target's (gamma+1)-token verify call instead of one step.")
      notes.append(
          "set-up / AR time: each example's set-up (encoding its input, the cross-attention "
          "cache), which both decoders pay once per example and the cost model does not "
          "charge, as a fraction of the autoregressive seconds per example: timed by the run "
          "(`experiment.measure.example_setup_seconds`, the target's encoder on its first "
          "batches; the draft model's set-up is charged to the speculative decoder too), or, "
          "for a run that did not time it, estimated as the autoregressive seconds per "
          "example less its mean output length x T_p. cost model + set-up = AR seconds / "
          "(set-up + the speculative decoder's target calls per example x (gamma c + "
          "T_verify/T_p) x step), c the run's c in the loop where it measured one (each "
          "proposal timed after a verify call), step = the autoregressive decode's own "
          "seconds per token "
          "beyond the set-up (T_p with an estimated set-up), so only the ratios c and "
          "T_verify/T_p come from timing loops run at another moment: the cost model "
          "charging the set-up and the calls the run made (a sequence that ends inside a "
          "block wastes the rest of it). measured / that: what the speculative loop loses "
          "beyond the models' work, against the autoregressive loop's efficiency.")
    if table == 2:
      notes.append("'= baseline': fraction of examples whose speculative output equals the "
                   "autoregressive one token for token (1.00 expected at temp 0; at temp 1 both "
                   "sample with the same keys but consume them differently).")
    return cols, out, notes
  if table == 3:
    cols = [Column("target", "target (paper)"), Column("draft", "draft (paper)"),
            Column("ours", "target / draft (ours)"), Column("paper_t0", "t=0 (paper)", a2),
            Column("t0", "t=0 (ours)", a2), Column("paper_t1", "t=1 (paper)", a2),
            Column("t1", "t=1 (ours)", a2), Column("note", "note")]
    for row in rows:
      if not row.jobs:
        out.append(dict(row.cells, note="not reproduced: no such models in this project"))
        continue
      labels = [get(row, "t0", f"experiment.{r}.name") for r in ("target", "draft")]
      out.append(dict(row.cells, t0=get(row, "t0", "alpha"), t1=get(row, "t1", "alpha"),
                      ours=" / ".join(l for l in labels if l) or None, note=_note(row, results)))
    notes = ["alpha = mean of sum_x min(p, q) over the positions speculative decoding decided "
             "(speculative runs only; gamma as in the paper's configs, 3 for n-grams)."]
    return cols, out, notes
  cols = [Column("draft", "draft (paper)")]
  for l in paper_tables.LENIENCES:
    cols += [Column(f"paper_l{l:g}", f"l={l:g} (paper)", a2), Column(f"l{l:g}", f"l={l:g} (ours)",
                                                                     a2)]
  cols.append(Column("note", "note"))
  for row in rows:
    out.append(dict(row.cells, **{cell: get(row, cell, "alpha") for cell in row.jobs},
                    note=_note(row, results)))
  notes = ["EnDe, temperature 1. alpha = mean of sum_x min(p(x) / l, q(x)) (the lenient "
           "acceptance probability, paper appendix A.5) over decided positions."]
  return cols, out, notes


def _setup_charged(entry: dict | None, gamma, c) -> dict:
  """The cost model charging what it leaves out, from a run's own numbers: each example's
  set-up (encoding, cross-attention cache) and the target calls the speculative decoder
  actually made (a sequence that ends inside a block wastes its rest): AR / (set-up + calls
  x (gamma c + T_verify / T_p) x step), and the measured speedup over it
  (`harness.setup_charged_speedup`). A run that timed its set-up (results.json
  timing.setup_seconds) charges it as measured, the draft model's too, and the step the
  autoregressive decode itself took per token; an older run's set-up is estimated as the
  autoregressive seconds per example less its tokens x T_p, with T_p from the timing loop.
  setup_measured says which. c: the draft's cost the run's gamma choice charged (its c in
  the loop where it measured one, `GammaChoice.in_loop_costs`)."""
  get = lambda key: _measured(entry, key)
  n, t_p, r = (get(k) for k in ("completed", "timing.target_step_seconds",
                                "timing.verify_ratio"))
  ar, spec = get("timing.autoregressive_seconds"), get("timing.speculative_seconds")
  length = get("mean_output_length")
  length = length.get("autoregressive") if isinstance(length, dict) else length
  calls = get("decoders.speculative.target_calls")
  if None in (n, t_p, c, r, ar, spec, length, calls, gamma) or not n or not gamma:
    return {}
  ar, spec, calls = ar / n, spec / n, calls / n
  measured = get("timing.setup_seconds") or {}
  setup, draft_setup = measured.get("target"), measured.get("draft", 0.0)
  model = harness.setup_charged_speedup(ar_seconds=ar, tokens=length, target_calls=calls,
                                        target_step=t_p, iteration_steps=gamma * c + r,
                                        setup=setup, draft_setup=draft_setup)
  if model is None or not ar or not spec:
    return {}
  fraction = (setup if setup is not None else max(ar - length * t_p, 0.0)) / ar
  return dict(setup_fraction=fraction, setup_model=model, setup_efficiency=(ar / spec) / model,
              setup_measured=setup is not None)


def orderings(table: int, out: list[dict]) -> list[dict]:
  """Per group of rows (Tables 2 and 4: task and temperature; Table 3: target), the drafts
  ordered by the paper's value and by ours, for speed and alpha (Table 3: alpha at t=0 and
  t=1); only drafts with both values. Each: {group, quantity, paper, ours, agree}."""
  if table in (2, 4):
    keys = ("task", "temp")
    quantities = (("speed", "paper_speed", "speed"), ("alpha", "paper_alpha", "alpha"))
  elif table == 3:
    keys = ("target",)
    quantities = (("alpha at t=0", "paper_t0", "t0"), ("alpha at t=1", "paper_t1", "t1"))
  else:
    return []
  groups: dict[tuple, list[dict]] = {}
  for row in out:
    groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
  result = []
  for group, rows in groups.items():
    for name, paper_key, ours_key in quantities:
      have = [r for r in rows if r.get(paper_key) is not None and r.get(ours_key) is not None]
      if len(have) < 2:
        continue
      order = lambda key: [r["draft"] for r in sorted(have, key=lambda r: -r[key])]
      paper, ours = order(paper_key), order(ours_key)
      result.append(dict(group=", ".join(f"{k} {v}" for k, v in zip(keys, group)),
                         quantity=name, paper=paper, ours=ours, agree=paper == ours))
  return result


def _orderings_md(items: list[dict]) -> str:
  if not items:
    return ""
  lines = ["## Orderings: paper vs ours", "",
           "Drafts from highest to lowest, by the paper's value and by ours (generated from "
           "the rows above).", "", "| group | quantity | paper | ours | same order |",
           "|---|---|---|---|---|"]
  for it in items:
    lines.append(f"| {it['group']} | {it['quantity']} | {' > '.join(it['paper'])} | "
                 f"{' > '.join(it['ours'])} | {'yes' if it['agree'] else 'no'} |")
  return "\n".join(lines) + "\n\n"


def _decoded_at(run_dir: str) -> str | None:
  """When a run's batches were last decoded (runs.json's latest 'finished'), or None."""
  try:
    with open(os.path.join(run_dir, "runs.json")) as f:
      runs = json.load(f)
    return max(str(r["finished"]) for r in runs.values())
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None


def _runs_md(rows: list[Row], results: dict) -> str:
  lines, seen = ["## Runs", "", "Each run's command, and when its examples were decoded (a "
                 "rerun finds a complete run and re-measures nothing: its numbers are those "
                 "of that time, whatever the date of this file).", ""], set()
  for row in rows:
    for cell, job in row.jobs.items():
      entry = results.get(job.key)
      if entry is None or job.key in seen:
        continue
      seen.add(job.key)
      when = f" (decoded {entry['decoded']})" if entry.get("decoded") else ""
      lines.append(f"- `{row.id}` {cell}{when}: `{entry['command']}`")
  return "\n".join(lines) + "\n" if seen else ""


# ------------------------------------------------------------------ main
def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--table", required=True, help="table numbers, e.g. 2 or 1,2,3,4,5 or all")
  p.add_argument("--scale", default="demo", choices=setups.SCALES)
  setups.add_demo_targets_flag(p)
  p.add_argument("--gamma", default=None, choices=GAMMA_RULES,
                 help="Tables 2 and 4: the paper's gamma, or chosen by each run from warm-up "
                 "measurements (default: auto with the big demo targets, else paper)")
  p.add_argument("--rows", default=None, help="only these row ids (e.g. ende_small_t0); the "
                 "other rows are listed as not run")
  p.add_argument("--num_examples", type=int, default=None,
                 help="examples per run (default: tiny 2, demo 50 timed / 100 alpha-only, "
                 "paper: the config's)")
  p.add_argument("--step_timing_repeats", type=int, default=None)
  p.add_argument("--timing_repeats", type=int, default=None)
  setups.add_refill_chunk_flag(p)
  p.add_argument("--checkpoints", default=None,
                 help="paper scale: NAME=PATH,... with names <task>_target, <task>_<draft>")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="extra gin bindings for every run, e.g. \"ExperimentConfig.mesh = "
                 "'data=1,model=8'\"")
  p.add_argument("--demo_models", default=None, help=f"demo model dir (default {setups.DEMO_DIR})")
  p.add_argument("--runs_dir", default=DEFAULT_RUNS_DIR)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--progress", action="store_true", help="progress bars per run")
  p.add_argument("--fail_fast", action="store_true", help="raise on the first failing run")
  args = p.parse_args(list(argv))
  text = args.table.strip().lower()
  args.tables = TABLES if text == "all" else harness.parse_ints(text, "table")
  if any(t not in TABLES for t in args.tables):
    p.error(f"--table must be among {TABLES} (or 'all'), got {args.table!r}")
  args.row_filter = None if args.rows is None else {r.strip() for r in args.rows.split(",")}
  if args.gamma is None:
    args.gamma = "auto" if _big(args) else "paper"
  args.refill_chunk = setups.refill_chunk_of(p, args)
  return args


@dataclasses.dataclass(frozen=True)
class _Args:
  """The options `plan` reads (a frozen copy of the parsed flags)."""
  scale: str
  demo_targets: str
  gamma: str
  demo_models: str | None
  checkpoints: str | None
  num_examples: int | None
  step_timing_repeats: int | None
  timing_repeats: int | None
  gin_bindings: tuple[str, ...]
  refill_chunk: int = 0


def run(args, meta) -> list[harness.Output]:
  pargs = _Args(args.scale, args.demo_targets, args.gamma, args.demo_models, args.checkpoints,
                args.num_examples, args.step_timing_repeats, args.timing_repeats,
                tuple(args.gin_bindings), args.refill_chunk)
  plans = {t: plan(t, pargs) for t in args.tables}
  unknown = (args.row_filter or set()) - {r.id for rows in plans.values() for r in rows}
  if unknown:
    raise ValueError(f"--rows names unknown rows {sorted(unknown)}")
  jobs = {job.key: job for rows in plans.values() for row in rows for job in row.jobs.values()
          if args.row_filter is None or row.id in args.row_filter}
  results = run_jobs(jobs, args)
  outs = []
  for t, rows in plans.items():
    cols, out, notes = render(t, rows, results)
    notes = [_scale_note(pargs)] + notes
    order = orderings(t, out)
    outs.append(harness.Output(f"table_{t}", f"Table {t}: paper vs this reproduction", cols,
                               out, notes, extra_md=_orderings_md(order) + _runs_md(rows, results),
                               extra={"orderings": order} if order else None))
  return outs


def main(argv: Sequence[str] | None = None) -> dict[int, dict[str, str]]:
  """Runs the requested tables; returns {table: {'md', 'csv', 'json': path}}."""
  written = harness.main("experiments.reproduce", argv, parse_args, run,
                         private=("results_dir", "runs_dir", "row_filter", "tables"))
  return {int(stem[len("table_"):]): paths for stem, paths in written.items()}


_SCALE_NOTES = {
    "tiny": "random tiny T5 models on the offline toy_reverse task; a pipeline check, the "
            "numbers mean nothing",
    "demo": "the demo models trained on CPU (demo_models/, configs/demo/) on the synthetic "
            "EnDe / CNNDM tasks, standing in for T5-XXL and its drafts",
    "paper": "T5.1.1 checkpoints on WMT EnDe / CNN-DM through configs/paper/",
}
_DEMO_TARGET_NOTES = {
    "big": "targets: the big demo targets (T5.1.1-small-shaped, 45.6M parameters), where a "
           "decode step is bound by reading the target's weights, as a T5-XXL step on an "
           "accelerator is; drafts by size ratio to them: T5-small -> demo small (0.44M, "
           "1/104; paper 1/144), T5-base -> demo base (0.81M, 1/56; paper 1/45), T5-large -> "
           "the 3.7M demo target (1/12; paper 1/14)",
    "small": "targets: the 3.7M demo targets, a kernel-launch-bound scale: on a CPU their "
             "decode step is bound by launching kernels, not by reading weights, so a verify "
             "call of gamma + 1 tokens costs 1.4-6 steps and speculation reads as a slowdown; "
             "drafts: demo small / base / large (1/8.3, 1/4.5, 1/2 of the target)",
}


def _scale_note(args: _Args) -> str:
  note = f"Scale: {args.scale} ({_SCALE_NOTES[args.scale]})"
  if args.scale == "demo":
    note += f"; {_DEMO_TARGET_NOTES[args.demo_targets]}"
  note += f". gamma of Tables 2 and 4: {args.gamma}."
  if args.refill_chunk:
    note += (f" Each decode call takes {args.refill_chunk} examples in the refill loop (a "
             "finished row's slot taken by the next example inside the jitted loop), in both "
             "decoders, as the big demo main jobs decode; speeds are over whole calls.")
  return note


if __name__ == "__main__":
  main()
