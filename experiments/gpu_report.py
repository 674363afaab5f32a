r"""The GPU engine report: T5-XXL-shaped step costs against the memory roofline, verify cost
t(N) = T_verify(N) / T_p, the drafts' costs, and the paper's Table 2 rows predicted with
the measured costs.

  python -m experiments.gpu_report --dir experiments/results/gpu_h200

Reads what `experiments/gpu_engine.sh` wrote on the GPU machine, unpacked into --dir:
benchmark_gpu_xxl_small_b{1,8,32}.json (experiments.benchmark), verify_scaling_xxl.json
(experiments.verify_scaling, N = 16 .. 1024) and drafts.log (the drafts' single-token
steps, as verify_scaling printed them; a run cut short leaves its printed lines only); where
present (the variants and one_row plans), step_*.json (experiments.step_variants: steps and
their kernel launches under XLA option variants; a draft's T_q is its newest "project"
row), benchmark_gpu_xxl_copy_b1.json (the XXL target drafting for itself: alpha about 1)
and benchmark_gpu_xxl_small_b1_one_row_as_one.json (the small-draft benchmark before
`models.t5.ONE_ROW_AS_TWO`). Writes --dir/README.md. Every figure comes from those files;
the paper's come from `experiments.paper_tables.TABLE4`.

Table 2 at the measured costs: for each of the paper's rows (its alpha and gamma), Thm 3.8
at c = T_q / T_p measured here, and the cost model that also charges the measured verify
cost, E[tokens](alpha, gamma) / (gamma c + t(gamma + 1)). Rows whose draft or gamma was
not measured say n/a.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sys
from typing import Any, Sequence

from experiments import harness, paper_tables
from experiments.harness import fmt

PRESET = {"small": "t5_1_1_small", "base": "t5_1_1_base", "large": "t5_1_1_large"}
DRAFT_LINE = re.compile(r"^(t5_1_1_\w+) \(random\) \(([\d.]+)M, [^)]*\): T_p ([\d.]+) ms")
GOALS = {"roofline": 0.8, "t8": 1.15, "model_work": 0.9}


def _load(path: str) -> dict[str, Any] | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def draft_steps(log_path: str) -> dict[str, float]:
  """{preset: seconds of one single-token step} from verify_scaling's printed lines."""
  out = {}
  if os.path.exists(log_path):
    with open(log_path) as f:
      for line in f:
        m = DRAFT_LINE.match(line.strip())
        if m:
          out[m.group(1)] = float(m.group(3)) / 1e3
  return out


def step_files(directory: str) -> list[tuple[str, dict[str, Any]]]:
  """(name, result) of each experiments.step_variants file, oldest run first."""
  out = [(os.path.basename(p), _load(p))
         for p in glob.glob(os.path.join(directory, "step_*.json"))]
  return sorted(out, key=lambda nr: nr[1]["meta"]["machine"].get("date", ""))


def project_steps(steps: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
  """{preset: its "project" row of the newest step_variants run that measured it, with the
  run's file and commit added}."""
  out = {}
  for name, res in steps:
    for row in res["rows"]:
      if row.get("variant") == "project" and row.get("t_ms"):
        out[row["model"].split(" ")[0]] = dict(
            row, file=name, commit=res["meta"]["machine"].get("git_commit"))
  return out


def _ms(s: float | None, digits: int = 3) -> str:
  return "n/a" if s is None else f"{s * 1e3:.{digits}f} ms"


def _speed(v) -> str:
  return fmt(v, 2, "X")


def _source(name: str, res: dict[str, Any]) -> str:
  m = res["meta"]["machine"]
  return (f"| `{name}` | {m.get('devices')} | {m.get('date', '')[:16]} | "
          f"{m.get('git_commit')} | `{res['meta']['command']}` |")


def table2(b1: dict[str, Any], drafts: dict[str, float],
           more_ratios: dict[int, float] | None = None) -> list[str]:
  """more_ratios: {gamma: t(gamma + 1)} for gammas the benchmark did not time."""
  from spec_decode import theory
  s = b1["summary"]
  t_p = s["target_step"]["median"]
  ratios = {**(more_ratios or {}), **{r["gamma"]: r["verify_ratio"] for r in b1["rows"]}}
  costs = dict(drafts)
  costs[s["draft"]["preset"]] = s["draft_step"]["median"]  # the benchmark's own T_q wins
  lines = ["| task | draft | t | gamma | alpha | paper c | c here | t(gamma+1) here | "
           "paper Thm 3.8 | Thm 3.8 here | cost model here | paper measured |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for task, draft, temp, g, alpha, c_paper, pred, speed in paper_tables.TABLE4:
    t_q = costs.get(PRESET[draft])
    c = None if t_q is None else t_q / t_p
    thm = None if c is None else float(theory.walltime_improvement(alpha, g, c))
    r = ratios.get(g)
    model = (None if c is None or r is None else
             float(theory.expected_tokens(alpha, g)) / (g * c + r))
    lines.append(f"| {task} | T5-{draft} | {temp} | {g} | {alpha} | {c_paper} | {fmt(c)} | "
                 f"{fmt(r)} | {pred}X | {_speed(thm)} | {_speed(model)} | {speed}X |")
  return lines


def report(directory: str, command: str, note: str | None = None) -> str:
  batches = {}
  for path in sorted(glob.glob(os.path.join(directory, "benchmark_gpu_xxl_small_b*.json"))):
    m = re.fullmatch(r"benchmark_gpu_xxl_small_b(\d+)\.json", os.path.basename(path))
    if m:
      batches[int(m.group(1))] = (os.path.basename(path), _load(path))
  if 1 not in batches:
    raise FileNotFoundError(f"{directory} has no benchmark_gpu_xxl_small_b1.json")
  b1 = batches[1][1]
  s1 = b1["summary"]
  scaling = _load(os.path.join(directory, "verify_scaling_xxl.json"))
  drafts = draft_steps(os.path.join(directory, "drafts.log"))
  step_runs = step_files(directory)
  newest = project_steps(step_runs)
  drafts.update({k: r["t_ms"]["1"] / 1e3 for k, r in newest.items() if k in PRESET.values()})
  extra = {n: _load(os.path.join(directory, f"benchmark_gpu_xxl_{n}.json"))
           for n in ("copy_b1", "small_b1_one_row_as_one")}
  device = b1["meta"]["machine"]["devices"]
  t_p = s1["target_step"]["median"]

  out = [f"# The engine at T5-XXL shapes on {device}", "",
         f"Made by `{command}` from the measured runs below (random bfloat16 weights, "
         "inputs of 512 random ids, decode length 128; step costs are marginal costs inside "
         "jitted loops, medians of interleaved rounds). Alpha and speedups of random models "
         "mean nothing; the paper's alphas are used for Table 2.", "",
         "| file | device | date (UTC) | commit as recorded | command |", "|---|---|---|---|---|"]
  out += [_source(name, res) for _, (name, res) in sorted(batches.items())]
  if scaling is not None:
    out.append(_source("verify_scaling_xxl.json", scaling))
  out += [_source(f"benchmark_gpu_xxl_{n}.json", res) for n, res in extra.items() if res]
  out += [_source(name, res) for name, res in step_runs]
  if note:
    out += ["", f"Note: {note}"]
  out += ["", "## Target step against the memory roofline", "",
          "Bytes one target step reads (`experiment.measure.decode_bytes`: weights, caches) "
          "over the device's measured copy bandwidth (a large device-to-device copy, bytes "
          "read plus written) give the step's floor; its ratio to the measured T_p is the "
          f"fraction of the roofline reached (goal >= {GOALS['roofline']}).", "",
          "| batch | T_p | bytes per step | copy bandwidth | roofline time | fraction | T_q "
          "(T5.1.1-small draft) | c |", "|---|---|---|---|---|---|---|---|"]
  for b, (_, res) in sorted(batches.items()):
    s, rl = res["summary"], res["summary"]["roofline"] or {}
    out.append(
        f"| {b} | {_ms(s['target_step']['median'])} | "
        f"{rl.get('bytes_per_step', 0) / 1e9:.2f} GB | "
        f"{rl.get('copy_bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s | "
        f"{_ms(rl.get('roofline_seconds'))} | **{fmt(rl.get('roofline_fraction'))}** | "
        f"{_ms(s['draft_step']['median'])} | {fmt(s['c'])} |")

  out += ["", "## Verify cost t(N) = T_verify(N) / T_p", "",
          f"Goal: t(8) <= {GOALS['t8']} at batch 1.", ""]
  ns = sorted({r["gamma"] + 1 for _, res in batches.values() for r in res["rows"]})
  big = sorted(int(n) for n in (scaling["rows"][0]["ratios"] if scaling else {}) if int(n) > 1)
  header = [f"t({n})" for n in ns] + [f"t({n})" for n in big]
  out += ["| batch | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
  for b, (_, res) in sorted(batches.items()):
    got = {r["gamma"] + 1: r["verify_ratio"] for r in res["rows"]}
    cells = [fmt(got.get(n)) for n in ns]
    if b == 1 and scaling is not None:
      cells += [fmt(scaling["rows"][0]["ratios"][str(n)]) for n in big]
    else:
      cells += ["" for _ in big]
    out.append(f"| {b} | " + " | ".join(cells) + " |")
  if scaling is not None:
    out += ["", f"t(16) .. t(1024): verify_scaling's own T_p "
            f"{scaling['rows'][0]['t_p_ms']:.3f} ms (cache filled to "
            f"{scaling['meta']['settings']['position']}), the benchmark's {t_p * 1e3:.3f} ms "
            f"(cache filled to 64 of 139 slots)."]

  out += ["", "## Draft steps (single token, batch 1)", "",
          "| draft | T_q | c = T_q / T_p |", "|---|---|---|"]
  steps = dict(drafts)
  steps[s1["draft"]["preset"]] = s1["draft_step"]["median"]
  for preset in PRESET.values():
    q = steps.get(preset)
    out.append(f"| {preset} | {_ms(q)} | {fmt(None if q is None else q / t_p)} |")
  sources = [f"{k} from `{r['file']}` (commit {r['commit']})" for k, r in sorted(newest.items())
             if k in PRESET.values() and k != s1["draft"]["preset"]]
  out += ["", "T5.1.1-small: the benchmark's draft step (its proposal loop / gamma); base and "
          "large: " + (", ".join(sources) + " (the project's options), else " if sources
                       else "") +
          "verify_scaling's T_p of that shape (vocabulary 32128, input 512); a shape "
          "the run did not reach is n/a."]
  out += _launches(step_runs) + _one_row(b1, extra["small_b1_one_row_as_one"])

  xxl = newest.get(s1["target"]["preset"]) if s1["target"].get("preset") else None
  more = ({int(n) - 1: v / xxl["t_ms"]["1"] for n, v in xxl["t_ms"].items() if n != "1"}
          if xxl else {})
  out += ["", "## Table 2 at the measured costs", ""] + table2(b1, drafts, more)
  if more:
    out += ["", "t(gamma + 1) for gammas the benchmark did not time: "
            + ", ".join(f"t({g + 1}) {v:.3f}" for g, v in sorted(more.items()))
            + f" from `{xxl['file']}` (commit {xxl['commit']})."]

  e = s1.get("e2e")
  if e is not None:
    g = e.get("engine") or {}
    out += ["", "## End to end (batch 1, random draft)", "",
            f"- autoregressive {e['autoregressive']['tokens_per_second']:.1f} tokens/s, "
            f"speculative (gamma {b1['meta']['settings'].get('gamma')}) "
            f"{e['speculative']['tokens_per_second']:.1f} tokens/s: {_speed(e['speedup'])} at "
            f"alpha {e['alpha']:.3f} (random weights: about one token per target call).",
            f"- loop overhead beyond the model calls: autoregressive "
            f"{_ms(e.get('ar_overhead_per_iteration'))} per token step "
            f"({fmt(e['ar_overhead_per_iteration'] / t_p)} of T_p); speculative "
            f"{_ms(e.get('spec_overhead_per_iteration'))} per iteration.",
            f"- decoders spending time only on model work at the iterations these calls ran: "
            f"{_speed(g.get('model_work_speedup'))}; measured **{fmt(g.get('model_work_efficiency'))} "
            f"of it** (goal >= {GOALS['model_work']})."]
  out += _copy_draft(extra["copy_b1"])
  return "\n".join(out) + "\n"


def _launches(steps: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
  """The step_variants rows: each model step's cost and kernel launches per variant."""
  if not steps:
    return []
  out = ["", "## A step's kernel launches under XLA options", "",
         "Marginal cost of one decode step (`experiments.step_variants`, batch 1, cache filled "
         "to 64) and the kernels its compiled loop body launches; T(1) / launches is the "
         "cost of each. \"again\" repeats the run's first variant (its spread).", "",
         "| file | model | variant | T(1) | T(N)/T(1) | launches (N = 1) | launches (largest N) | "
         "T(1) per launch |", "|---|---|---|---|---|---|---|---|"]
  for name, res in steps:
    for r in res["rows"]:
      if not r.get("t_ms"):
        out.append(f"| `{name}` | {r['model']} | {r['variant']} | not measured: "
                   f"{r.get('error')} | | | | |")
        continue
      t = r["t_ms"]
      ratios = ", ".join(f"N={n}: {v / t['1']:.3f}" for n, v in t.items() if n != "1")
      out.append(f"| `{name}` | {r['model']} | {r['variant']} | {t['1']:.3f} ms | "
                 f"{ratios or 'n/a'} | {r['launches']['total']} | {r.get('launches_max')} | "
                 f"{r['us_per_launch']:.2f} us |")
  return out


def _one_row(after: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
  """The small-draft benchmark before / after `models.t5.ONE_ROW_AS_TWO`."""
  if before is None:
    return []
  rows = [("T_p (target step)", lambda s: _ms(s["target_step"]["median"])),
          ("T_q (draft step, in its proposal loop)", lambda s: _ms(s["draft_step"]["median"])),
          ("c", lambda s: fmt(s["c"])),
          ("autoregressive tokens/s",
           lambda s: fmt(s["e2e"]["autoregressive"]["tokens_per_second"], 1)),
          ("speculative tokens/s (random draft, alpha 0)",
           lambda s: fmt(s["e2e"]["speculative"]["tokens_per_second"], 1))]
  out = ["", "## One-row products: before / after", "",
         "The same benchmark (T5-XXL shape, T5.1.1-small draft, batch 1) with one-row "
         "products as XLA lowers them (a multiply and a reduction: "
         "`benchmark_gpu_xxl_small_b1_one_row_as_one.json`, run with "
         "`models.t5.ONE_ROW_AS_TWO = False`) and as two equal rows, one GEMM (the default "
         "on GPUs: `benchmark_gpu_xxl_small_b1.json`), one after the other on one machine.",
         "", "| | before | after |", "|---|---|---|"]
  out += [f"| {label} | {f(before['summary'])} | {f(after['summary'])} |" for label, f in rows]
  return out


def _copy_draft(res: dict[str, Any] | None) -> list[str]:
  """The XXL target with a copy of itself as the draft: the engine at alpha about 1."""
  if res is None:
    return []
  s, e = res["summary"], res["summary"]["e2e"]
  g = e.get("engine") or {}
  return ["", "## End to end with a draft of known alpha (a copy of the target)", "",
          f"The draft is the target's own weights (`--draft t5_1_1_xxl --draft_seed 0`), so at "
          f"t=0 nearly every proposal is accepted and c is about 1: the run checks the engine "
          f"when whole blocks are accepted, not the speedup.", "",
          f"- measured alpha {e['alpha']:.3f}, {e['tokens_per_target_call']:.2f} tokens per "
          f"target call; T_p {_ms(s['target_step']['median'])}, T_q "
          f"{_ms(s['draft_step']['median'])}, c {fmt(s['c'])}.",
          f"- autoregressive {e['autoregressive']['tokens_per_second']:.1f} tokens/s, "
          f"speculative (gamma {res['rows'][0]['gamma']}) "
          f"{e['speculative']['tokens_per_second']:.1f} tokens/s: {_speed(e['speedup'])}.",
          f"- loop overhead: autoregressive {_ms(e.get('ar_overhead_per_iteration'))} per "
          f"token step, speculative {_ms(e.get('spec_overhead_per_iteration'))} per iteration.",
          f"- decoders spending time only on model work: {_speed(g.get('model_work_speedup'))}; "
          f"measured **{fmt(g.get('model_work_efficiency'))} of it** "
          f"(goal >= {GOALS['model_work']})."]


def main(argv: Sequence[str] | None = None) -> str:
  p = argparse.ArgumentParser(prog="python -m experiments.gpu_report", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dir", required=True, help="the unpacked results of gpu_engine.sh")
  p.add_argument("--note", default=None, help="a sentence printed under the list of runs "
                 "(e.g. which tree ran where the recorded commit is wrong)")
  args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
  command = "python -m experiments.gpu_report " + shlex.join(
      sys.argv[1:] if argv is None else list(argv))
  text = report(args.dir, command, args.note)
  path = os.path.join(args.dir, "README.md")
  with open(path, "w") as f:
    f.write(text)
  print(text)
  return path


if __name__ == "__main__":
  with harness.cli_errors("experiments.gpu_report"):
    main()
