"""The results of an experiment, aggregated from its prediction rows, and its table row.

Everything here is a function of the rows in predictions.jsonl (plus this
run's step-time measurements), so a resumed run reports the same quantities
as an uninterrupted one: quality of both decoders, identical fraction, alpha
(observed and estimated), tokens per target call, per-position acceptance,
total decode seconds of each decoder summed over batches, the measured
speedup, and Theorem 3.8's prediction from the measured alpha and c.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from spec_decode import data, metrics, theory

if TYPE_CHECKING:
  from spec_decode.experiment import ExperimentConfig

TASK_LABELS = {"wmt_t2t_ende_v003": "EnDe", "cnn_dailymail_v002": "CNNDM",
               "synthetic_ende": "EnDe (synthetic)", "synthetic_cnndm": "CNNDM (synthetic)"}
TABLE_HEADER = ("| task | draft | temp | gamma | alpha | c | predicted | measured |\n"
                "|---|---|---|---|---|---|---|---|\n")


def _fmt(x, digits: int = 2) -> str:
  return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table_row(config: "ExperimentConfig", summary: Mapping[str, Any]) -> str:
  """This run as a row of the paper's Table 4 (Table 2's columns plus c and the prediction).

  alpha is the estimated alpha (mean beta); c has 3 decimals (the paper's 2
  would round small drafts to 0); speedups are walltime factors over the baseline.
  """
  return (f"| {TASK_LABELS.get(config.task, config.task)} | {config.draft.label} | "
          f"{config.temperature:g} | {config.gamma} | {_fmt(summary['alpha'])} | "
          f"{_fmt(summary['timing']['c'], 3)} | {_fmt(summary['speedup_predicted'])} | "
          f"{_fmt(summary['speedup_measured'])} |")


def summarize(cfg: "ExperimentConfig", *, metric_fns: Sequence[Callable],
              examples: Sequence[data.Example], rows: Mapping[int, dict],
              step_times: Mapping[str, float],
              compile_times: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
  """The results dict of an experiment from the rows of its examples (written by any run).

  metric_fns: the task's (targets, predictions) -> dict metrics. step_times:
  `experiment.measure_step_times`. compile_times: this run's first-call and
  compile seconds per decoder (empty when it decoded nothing).
  """
  done = [rows[ex.index] for ex in examples if ex.index in rows]
  if not done:
    raise ValueError("no decoded rows to summarize")
  col = lambda k: [r[k] for r in done]
  targets = col("target")
  out: dict[str, Any] = {
      "experiment": cfg.to_json(), "num_examples": len(examples), "completed": len(done),
      "metrics": {"speculative": metrics.quality(metric_fns, targets,
                                                 col("spec_output"))},
      "mean_output_length": {"speculative": float(np.mean(col("spec_length")))},
  }
  acc = metrics.acceptance(accepted=col("accepted"), decisions=col("decisions"),
                           min_pq_sum=col("min_pq_sum"), target_calls=col("target_calls"),
                           lengths=col("spec_length"))
  out.update(acc)
  out["alpha"] = acc["alpha_estimated"]
  out["per_position_acceptance"] = metrics.per_position_acceptance(
      np.sum(col("accepted_at"), axis=0), np.sum(col("decided_at"), axis=0))
  batches = {r["batch"]: r for r in done}
  spec_s = float(sum(r["spec_batch_seconds"] for r in batches.values()))
  t = dict(step_times, speculative_seconds=spec_s,
           first_call_seconds=dict(compile_times.get("first_call_seconds", {})),
           compile_seconds=dict(compile_times.get("compile_seconds", {})))
  out["speedup_measured"] = None
  if cfg.run_baseline:
    ar_s = float(sum(r["ar_batch_seconds"] for r in batches.values()))
    t["autoregressive_seconds"] = ar_s
    out["metrics"]["autoregressive"] = metrics.quality(metric_fns, targets,
                                                       col("ar_output"))
    out["mean_output_length"]["autoregressive"] = float(np.mean(col("ar_length")))
    out["identical_fraction"] = metrics.identical_fraction(col("ar_tokens"), col("spec_tokens"))
    out["autoregressive_target_calls"] = int(np.sum(col("ar_target_calls")))
    out["speedup_measured"] = ar_s / spec_s if spec_s > 0 else None
  out["timing"] = t
  alpha, c = out["alpha"], step_times["c"]
  if math.isnan(alpha):
    out["speedup_predicted"] = out["expected_tokens_per_call"] = out["optimal_gamma"] = None
  else:
    out["speedup_predicted"] = float(theory.walltime_improvement(alpha, cfg.gamma, c))
    out["expected_tokens_per_call"] = float(theory.expected_tokens(alpha, cfg.gamma))
    out["optimal_gamma"] = int(theory.optimal_gamma(alpha, c))
  out["table_row"] = table_row(cfg, out)
  return out
