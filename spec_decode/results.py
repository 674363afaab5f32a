"""An experiment's output directory: rows appended per batch, resumable, and the summaries.

  predictions.jsonl  one JSON object per example, keyed by "index"; a batch's
                     rows are appended in one write and fsync'ed, so a killed
                     run loses at most the batch in flight
  config.json        the experiment's settings; a rerun must match them
  progress.json      completed / total examples (informational)
  results.json       final metrics, computed from all rows of predictions.jsonl
  table_row.md       the paper's Table 4 header and this run's row

`read_rows` drops a partial last line (a write cut by a kill) from the file,
so appending continues on a clean line boundary.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

PREDICTIONS = "predictions.jsonl"
CONFIG = "config.json"
PROGRESS = "progress.json"
RESULTS = "results.json"
TABLE_ROW = "table_row.md"


def read_rows(path: str) -> dict[int, dict]:
  """{index: row} of a predictions file (empty if absent); the first row of an index wins."""
  if not os.path.exists(path):
    return {}
  with open(path, "rb") as f:
    data = f.read()
  complete = data.rfind(b"\n") + 1
  rows: dict[int, dict] = {}
  for lineno, line in enumerate(data[:complete].splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      index = int(row["index"])
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path}:{lineno} is not a prediction row: {line[:200]!r}") from e
    rows.setdefault(index, row)
  if complete < len(data):
    with open(path, "r+b") as f:
      f.truncate(complete)
  return rows


def append_rows(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
  """Appends rows as JSON lines in one write, flushed and fsync'ed."""
  text = "".join(json.dumps(dict(r), sort_keys=True, allow_nan=True) + "\n" for r in rows)
  if not text:
    return
  with open(path, "a", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def write_json(path: str, obj: Any) -> None:
  """Writes obj as JSON atomically (temporary file, then rename)."""
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True, allow_nan=True)
    f.write("\n")
  os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def check_config(output_dir: str, config: Mapping[str, Any], *,
                 may_differ: Iterable[str] = ()) -> None:
  """Records `config` in output_dir, or checks that a previous run there used the same one.

  Keys in `may_differ` may change between runs (e.g. num_examples: a rerun
  with more examples extends the same predictions).
  """
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, CONFIG)
  config = json.loads(json.dumps(dict(config), sort_keys=True))
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      previous = json.load(f)
    skip = set(may_differ)
    changed = sorted(k for k in set(previous) | set(config)
                     if k not in skip and previous.get(k) != config.get(k))
    if changed:
      detail = "; ".join(f"{k}: {previous.get(k)!r} -> {config.get(k)!r}" for k in changed)
      raise ValueError(f"{output_dir} holds a run of a different experiment ({detail}); "
                       f"use a new output_dir or restore the settings to resume")
  write_json(path, config)
