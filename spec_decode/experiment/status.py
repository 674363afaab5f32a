"""Where a run stands among the runs of its output directory, and what the results record of it.

  resume_state      "decoding N", "resuming K/N" or "already complete"
  recorded_step_times  the step times (c) measured by the last run that decoded
                    rows here, so a rerun that decodes nothing measures nothing
                    and cannot pair new c with old rows
  run_info          what runs.json keeps of a run that decoded rows
  summary_extras    the results' 'resume', 'runs' (each run's own speedup and
                    c), 'truncated' (inputs/targets cut to the feature lengths)
                    'nonfinite_rows' (rows whose target logits held NaN/Inf, per decoder)
                    and 'notices' (what a person must know to read the numbers)

Policy: rows are never re-decoded and measurements never overwritten. The
headline measured speedup pools the batch timings of all rows (each batch's
baseline and speculative times come from one run); when the rows come from
more than one run, 'runs' lists each run's own speedup and c and a notice says
so, and runs on different devices get a notice that their timings do not
compare.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax

from spec_decode import data
from spec_decode.experiment import results


def resume_state(total: int, todo: int, predictions_path: str) -> dict[str, Any]:
  done = total - todo
  if done == 0:
    message = f"decoding {total} examples into {os.path.dirname(predictions_path) or '.'}"
  elif todo:
    message = (f"resuming {done}/{total}: {done} examples are already in {predictions_path}; "
               f"decoding the remaining {todo}")
  else:
    message = (f"already complete: all {total} examples are in {predictions_path}; nothing is "
               "decoded or re-measured, the summary is recomputed from them")
  return {"total": total, "already_done": done, "decoded_now": todo,
          "already_complete": todo == 0 and done > 0, "message": message}


def recorded_step_times(output_dir: str) -> dict[str, float] | None:
  """The step times of the most recent run recorded in runs.json, or None."""
  runs = [r for r in results.read_runs(output_dir).values() if r.get("step_times")]
  if not runs:
    return None
  return dict(max(runs, key=lambda r: r.get("recorded", 0.0))["step_times"])


def devices() -> str:
  return f"{jax.devices()[0].device_kind} x{jax.device_count()}"


def run_info(step_times: Mapping[str, float]) -> dict[str, Any]:
  return {"step_times": dict(step_times), "c": step_times.get("c"), "devices": devices()}


def nonfinite_rows(rows) -> dict[str, int]:
  """{decoder: rows whose target logits held NaN/Inf in some call} over prediction rows
  (decoders that count `nonfinite_calls`), only decoders with at least one such row."""
  out: dict[str, int] = {}
  for row in rows:
    for name, dec in row.get("decoders", {}).items():
      if dec.get("stats", {}).get("nonfinite_calls", 0) > 0:
        out[name] = out.get(name, 0) + 1
  return out


def summary_extras(output_dir: str, rows: Mapping[int, dict], examples: Sequence[data.Example],
                   config, resume: Mapping[str, Any]) -> dict[str, Any]:
  indices = {ex.index for ex in examples}
  by_run = results.timing_by_run({i: r for i, r in rows.items() if i in indices},
                                 results.read_runs(output_dir))
  notices = []
  if len(by_run) > 1:
    own = ", ".join(f"{rid} ({r['rows']} rows): speedup "
                    + (f"{r['speedup_measured']:.2f}X" if r.get("speedup_measured") else "n/a")
                    + (f", c {r['c']:.3f}" if r.get("c") is not None else "")
                    for rid, r in by_run.items())
    notices.append(f"the rows were decoded by {len(by_run)} runs ({own}); the measured "
                   "speedup pools their batch timings; each run's own numbers are in "
                   "results.json 'runs'")
  kinds = {r["devices"] for r in by_run.values() if r.get("devices")}
  if len(kinds) > 1:
    notices.append(f"those runs used different devices ({', '.join(sorted(kinds))}): their "
                   "timings do not compare; use a new output_dir for one clean measurement")
  nonfinite = nonfinite_rows(rows[i] for i in sorted(indices) if i in rows)
  if nonfinite:
    notices.append("non-finite target logits (NaN or infinity) in "
                   + ", ".join(f"{n} of {len(indices)} rows of {name}"
                               for name, n in sorted(nonfinite.items()))
                   + ": those outputs are not the model's (an argmax over NaN is PAD); the "
                   "rows' 'nonfinite_calls' counter in predictions.jsonl marks them; check "
                   "the checkpoint (a diverged or badly converted model)")
  asked = config.num_examples
  if asked is not None and asked > len(examples):
    notices.append(f"{asked} examples were asked for (NUM_EXAMPLES) but the "
                   f"{config.split!r} split of {config.task} has {len(examples)}: all "
                   f"{len(examples)} were decoded")
  truncated = data.truncation_counts(examples, config.feature_lengths)
  if truncated.get("inputs"):
    notices.append(f"{truncated['inputs']} of {len(examples)} inputs were longer than "
                   f"{truncated['inputs_length']} tokens and were cut (raise INPUT_LENGTH / "
                   "feature_lengths['inputs'] to keep them whole)")
  if truncated.get("targets"):
    notices.append(f"{truncated['targets']} of {len(examples)} references are longer than "
                   f"{truncated['targets_length']} tokens, so no output can match them whole "
                   "(outputs stop at max_decode_len; raise TARGET_LENGTH)")
  return {"resume": {k: v for k, v in resume.items() if k != "message"}, "runs": by_run,
          "truncated": truncated, "nonfinite_rows": nonfinite, "notices": notices}
