"""The results of an experiment, aggregated from its prediction rows, and its table row.

Everything here is a function of the rows in predictions.jsonl (plus this
run's step-time measurements), so a resumed run reports the same quantities
as an uninterrupted one. Per decoder: quality, mean output length, total
decode seconds summed over batches; for each decoder other than the baseline:
its acceptance statistics (when it counts them), the measured speedup and the
identical fraction against the baseline, and the predictions of its cost model
(Thm 3.8 and the measured-verify-cost model) where the algorithm declares one.
The first such decoder (the primary one) is also reported at the top level and
in the paper's Table-4-style row.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from spec_decode import data, metrics

TASK_LABELS = {"wmt_t2t_ende_v003": "EnDe", "cnn_dailymail_v002": "CNNDM",
               "synthetic_ende": "EnDe (synthetic)", "synthetic_cnndm": "CNNDM (synthetic)"}
TABLE_HEADER = ("| task | draft | temp | gamma | alpha | c | predicted | measured |\n"
                "|---|---|---|---|---|---|---|---|\n")
_ACCEPTANCE = ("accepted", "decisions", "min_pq_sum", "target_calls")
# The primary decoder's entries repeated at the top level of the results.
_PRIMARY_KEYS = ("alpha_observed", "alpha_estimated", "tokens_per_target_call",
                 "tokens_first_call", "tokens_per_later_call", "accepted_per_target_call",
                 "decisions", "target_calls", "alpha",
                 "per_position_acceptance", "speedup_measured", "identical_fraction",
                 "speedup_predicted", "cost_model_speedup", "expected_tokens_per_call",
                 "optimal_gamma")


def _fmt(x, digits: int = 2) -> str:
  return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def md_cell(text: Any) -> str:
  """`text` as one Markdown table cell: line breaks become spaces, '|' is escaped."""
  return " ".join(str(text).split()).replace("|", "\\|")


def table_row(config, summary: Mapping[str, Any]) -> str:
  """The primary decoder as a row of the paper's Table 4 (Table 2's columns plus c and the
  prediction). alpha is the estimated alpha (mean beta); c has 3 decimals (the paper's 2
  would round small drafts to 0); speedups are walltime factors over the baseline.
  """
  algo = config.algorithms[config.primary]
  draft = md_cell(config.draft.label) if config.draft is not None else "-"
  gamma = "-" if algo.gamma is None else algo.gamma
  return (f"| {md_cell(TASK_LABELS.get(config.task, config.task))} | {draft} | "
          f"{config.sampling.temperature:g} | {gamma} | {_fmt(summary['alpha'])} | "
          f"{_fmt(summary['timing'].get('c'), 3)} | {_fmt(summary['speedup_predicted'])} | "
          f"{_fmt(summary['speedup_measured'])} |")


def _decoder_summary(cfg, name: str, done: Sequence[dict], seconds: Mapping[str, float],
                     step_times: Mapping[str, Any]) -> dict[str, Any]:
  """Acceptance, speedup/identity against the baseline and cost-model predictions of one."""
  algo = cfg.algorithms[name]
  stats = [r["decoders"][name]["stats"] for r in done]
  lengths = [r["decoders"][name]["length"] for r in done]
  d: dict[str, Any] = {"algorithm": type(algo).__name__}
  d.update(acceptance_summary(stats, lengths))
  baseline = cfg.baseline_name
  d["speedup_measured"] = d["identical_fraction"] = None
  if baseline is not None:
    d["speedup_measured"] = seconds[baseline] / seconds[name] if seconds[name] > 0 else None
    d["identical_fraction"] = metrics.identical_fraction(
        [r["decoders"][baseline]["tokens"] for r in done],
        [r["decoders"][name]["tokens"] for r in done])
  alpha, t_p = d.get("alpha"), step_times.get("target_step_seconds")
  proposal = step_times.get("proposal_seconds", {}).get(name)
  size = algo.max_proposal
  ratio = step_times.get("verify_ratio_by_tokens", {}).get(str(size + 1)) if size else None
  in_loop = step_times.get("c_in_loop_by_decoder", {}).get(name)
  if in_loop is not None and size and t_p is not None:  # its cost where the loop runs it
    proposal = in_loop * algo.gamma * t_p
  model = None
  if alpha is not None and not math.isnan(alpha) and None not in (proposal, t_p, ratio):
    model = algo.cost_model(alpha=alpha, draft_cost=proposal / t_p, verify_ratio=ratio,
                            counters=_summed(stats))
  d["c"] = step_times.get("c_by_decoder", {}).get(name)
  if in_loop is not None:
    d["c_in_loop"] = in_loop
  d["cost_model"] = model  # None where the algorithm declares none (or alpha is unknown)
  d["speedup_predicted"] = model["thm_3_8"] if model else None
  d["cost_model_speedup"] = model["cost_model"] if model else None
  d["expected_tokens_per_call"] = model["expected_tokens"] if model else None
  d["optimal_gamma"] = model.get("optimal_gamma") if model else None
  return d


def row_stats(stats, r: int) -> dict[str, Any]:
  """Row r's counters of `stats` (a `DecodeStats`) as JSON values (ints, floats, or lists for
  per-position ones): what a prediction row keeps."""
  out = {}
  for name, v in stats.counters.items():
    x = np.asarray(v)[r]
    out[name] = x.tolist() if x.ndim else (float(x) if x.dtype.kind == "f" else int(x))
  return out


def acceptance_summary(stats: Sequence[Mapping[str, Any]], lengths: Sequence[int]
                       ) -> dict[str, Any]:
  """One decoder's acceptance statistics from its rows' counters (`DecodeStats` as JSON
  values, one dict per row) and output lengths: `metrics.acceptance` (alpha observed and
  estimated, tokens per target call, ...) with alpha = the estimate, the mean drafted
  length per call and the per-position acceptance, where the decoder counts them ({} for
  one that counts no acceptance, the baseline)."""
  d: dict[str, Any] = {}
  if not stats or not all(k in stats[0] for k in _ACCEPTANCE):
    return d
  d.update(metrics.acceptance(**{k: [st[k] for st in stats] for k in _ACCEPTANCE},
                              lengths=lengths))
  d["alpha"] = d["alpha_estimated"]
  if "draft_tokens" in stats[0]:  # mean proposed length (an adaptive drafter varies it)
    calls = sum(st["target_calls"] for st in stats)
    d["drafted_per_target_call"] = (sum(st["draft_tokens"] for st in stats) / calls
                                    if calls else float("nan"))
  if all("first_call_tokens" in st for st in stats):
    d.update(metrics.first_call_split(
        first_call_tokens=[st["first_call_tokens"] for st in stats],
        target_calls=[st["target_calls"] for st in stats], lengths=lengths))
  if "accepted_at" in stats[0]:
    d["per_position_acceptance"] = metrics.per_position_acceptance(
        np.sum([st["accepted_at"] for st in stats], axis=0),
        np.sum([st["decided_at"] for st in stats], axis=0))
  return d


def _summed(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Counters summed over rows (per-position ones elementwise, as lists)."""
  if not stats:
    return {}
  return {k: (np.sum([st[k] for st in stats], axis=0).tolist()
              if isinstance(stats[0][k], list) else sum(st[k] for st in stats))
          for k in stats[0]}


def summarize(cfg, *, metric_fns: Sequence[Callable], examples: Sequence[data.Example],
              rows: Mapping[int, dict], step_times: Mapping[str, Any],
              compile_times: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
  """The results dict of an experiment (`cfg`: its ExperimentConfig) from its rows.

  metric_fns: the task's (targets, predictions) -> dict metrics. step_times:
  `experiment.measure.measure_step_times`. compile_times: this run's first-call and
  compile seconds per decoder (empty when it decoded nothing).
  """
  done = [rows[ex.index] for ex in examples if ex.index in rows]
  if not done:
    raise ValueError("no decoded rows to summarize")
  names = list(cfg.algorithms)
  missing = sorted({n for r in done for n in names if n not in r.get("decoders", {})})
  if missing:
    raise ValueError(f"prediction rows lack the outputs of decoders {missing}: they were "
                     "written by another configuration; use a new output_dir")
  targets = [r["target"] for r in done]
  col = lambda name, key: [r["decoders"][name][key] for r in done]
  batches = {r["batch"]: r for r in done}
  seconds = {n: float(sum(b["decoders"][n]["batch_seconds"] for b in batches.values()))
             for n in names}
  out: dict[str, Any] = {
      "experiment": cfg.to_json(), "num_examples": len(examples), "completed": len(done),
      "baseline": cfg.baseline_name, "primary": cfg.primary,
      "metrics": {n: metrics.quality(metric_fns, targets, col(n, "output")) for n in names},
      "mean_output_length": {n: float(np.mean(col(n, "length"))) for n in names},
      "decoders": {n: _decoder_summary(cfg, n, done, seconds, step_times)
                   for n in names if n != cfg.baseline_name},
  }
  out["timing"] = dict(step_times, **{f"{n}_seconds": seconds[n] for n in names},
                       first_call_seconds=dict(compile_times.get("first_call_seconds", {})),
                       compile_seconds=dict(compile_times.get("compile_seconds", {})))
  if cfg.baseline is not None:
    out["autoregressive_target_calls"] = int(sum(st["target_calls"] for st in
                                                 col(cfg.baseline_name, "stats")))
  primary = out["decoders"].get(cfg.primary, {})
  out.update({k: primary.get(k) for k in _PRIMARY_KEYS})
  out["table_row"] = table_row(cfg, out) if cfg.primary else ""
  out["machine"] = machine()
  return out


def machine() -> dict[str, Any]:
  """Where the decoders ran: the backend and devices; on CPU also the CPU's model and
  features, and the decode kernel (on or why not, the variant chosen per weight shape,
  the weight formats the models were packed in: `cpu_matmul.describe`); the compilation
  cache (`compile_cache.stats`: its directory, and how many of this process's compilations
  it answered)."""
  import jax
  from spec_decode import compile_cache
  from spec_decode.kernels import cpu_matmul
  devices = jax.devices()
  out: dict[str, Any] = {"backend": jax.default_backend(),
                         "devices": f"{len(devices)} x {devices[0].device_kind}"}
  if out["backend"] == "cpu":
    out["cpu"] = cpu_matmul.describe()
  out["compile_cache"] = compile_cache.stats()
  return out


def machine_line(m: Mapping[str, Any]) -> str:
  """One line naming the machine of `machine()`: CPU model and features, the kernel's
  weight formats and the variants it used (how many weight shapes each)."""
  cpu = m.get("cpu")
  if not cpu:
    return f"{m.get('backend')}: {m.get('devices')}"
  line = f"CPU {cpu['model']} ({', '.join(cpu['features']) or 'no listed features'})"
  if cpu.get("kernel") != "on":
    return line + f"; decode kernel {cpu.get('kernel')}"
  used: dict[str, int] = {}
  for variant in cpu.get("chosen_variants", {}).values():
    used[variant] = used.get(variant, 0) + 1
  if cpu.get("variant_override"):
    used = {f"{cpu['variant_override']} (fixed by environment)": 0}
  weights = ", ".join(f"{w} x{n}" for w, n in cpu.get("packed_weights", {}).items())
  return (line + f"; decode kernel weights {weights or 'not packed'}; variants "
          + (", ".join(f"{v}" + (f" ({n} shapes)" if n else "") for v, n in sorted(used.items()))
             or "none chosen"))
