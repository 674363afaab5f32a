r"""The GPU engine report: T5-XXL-shaped step costs against the memory roofline, verify cost
t(N) = T_verify(N) / T_p, the drafts' costs, and the paper's Table 2 rows predicted with
the measured costs.

  python -m experiments.gpu_report --dir experiments/results/gpu_h200

Reads what `experiments/gpu_engine.sh` wrote on the GPU machine, unpacked into --dir:
benchmark_gpu_xxl_small_b{1,8,32}.json (experiments.benchmark), verify_scaling_xxl.json
(experiments.verify_scaling, N = 16 .. 1024) and drafts.log (the drafts' single-token
steps, as verify_scaling printed them; a run cut short leaves its printed lines only).
Writes --dir/README.md. Every figure comes from those files; the paper's come from
`experiments.paper_tables.TABLE4`.

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

from experiments import paper_tables
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


def _ms(s: float | None, digits: int = 3) -> str:
  return "n/a" if s is None else f"{s * 1e3:.{digits}f} ms"


def _speed(v) -> str:
  return fmt(v, 2, "X")


def _source(name: str, res: dict[str, Any]) -> str:
  m = res["meta"]["machine"]
  return (f"| `{name}` | {m.get('devices')} | {m.get('date', '')[:16]} | "
          f"{m.get('git_commit')} | `{res['meta']['command']}` |")


def table2(b1: dict[str, Any], drafts: dict[str, float]) -> list[str]:
  from spec_decode import theory
  s = b1["summary"]
  t_p = s["target_step"]["median"]
  ratios = {r["gamma"]: r["verify_ratio"] for r in b1["rows"]}
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
    b = int(re.search(r"_b(\d+)\.json$", path).group(1))
    batches[b] = (os.path.basename(path), _load(path))
  if 1 not in batches:
    raise FileNotFoundError(f"{directory} has no benchmark_gpu_xxl_small_b1.json")
  b1 = batches[1][1]
  s1 = b1["summary"]
  scaling = _load(os.path.join(directory, "verify_scaling_xxl.json"))
  drafts = draft_steps(os.path.join(directory, "drafts.log"))
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
  out += ["", "T5.1.1-small: the benchmark's draft step (its proposal loop / gamma); base and "
          "large: verify_scaling's T_p of that shape (vocabulary 32128, input 512); a shape "
          "the run did not reach is n/a."]

  out += ["", "## Table 2 at the measured costs", ""] + table2(b1, drafts)

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
  return "\n".join(out) + "\n"


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
  main()
