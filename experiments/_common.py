"""What every experiment driver shares: the machine description, statistics, result files.

Each driver writes `<results_dir>/<stem>.md` (a title, the exact command, the
machine, the date, notes and a markdown table), `<stem>.csv` (the same rows,
raw numbers) and `<stem>.json` ({"meta", "columns", "rows", "notes"}), so a
README section can be regenerated from the JSON files (`results_readme.py`).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "experiments", "results")


# ------------------------------------------------------------------ machine and command
def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def _git_commit() -> str | None:
  try:
    out = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def machine() -> dict[str, Any]:
  """Where and when a measurement ran: CPU model, cores (nproc), JAX devices, load, date."""
  import jax
  devices = jax.devices()
  try:
    nproc = len(os.sched_getaffinity(0))
  except AttributeError:
    nproc = os.cpu_count()
  return {
      "cpu_model": _cpu_model(),
      "nproc": nproc,
      "backend": jax.default_backend(),
      "devices": f"{len(devices)} x {devices[0].device_kind}",
      "jax": jax.__version__,
      "load_average_1m": round(os.getloadavg()[0], 2),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "git_commit": _git_commit(),
  }


def machine_line(m: Mapping[str, Any]) -> str:
  """One line for a table header, e.g. '2 cores of Intel Xeon ..., jax 0.10.2 (cpu: 1 x cpu)'."""
  line = (f"{m['nproc']} cores of {m['cpu_model']}, jax {m['jax']} "
          f"({m['backend']}: {m['devices']}), load average {m['load_average_1m']} at start")
  if m.get("load_average_1m_end") is not None:
    line += f", {m['load_average_1m_end']} at end"
  return line


def quote(arg: str) -> str:
  """A shell word for arg: bare when safe, in double quotes when it holds only single quotes."""
  if not arg or any(ch in arg for ch in "\"$`\\!"):
    return shlex.quote(arg)
  return arg if shlex.quote(arg) == arg else f'"{arg}"'


def command_line(module: str, argv: Sequence[str]) -> str:
  """The shell command that reruns a driver: 'python -m experiments.X ARGS'."""
  return " ".join(["python", "-m", module, *map(quote, argv)])


def finish_meta(meta: dict[str, Any]) -> dict[str, Any]:
  """Adds the end-of-run load average (contention during the measurement)."""
  meta["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
  return meta


# ------------------------------------------------------------------ statistics
def spread(values: Sequence[float]) -> dict[str, float]:
  """median, 25th/75th percentiles, min, max and count of repeated measurements."""
  v = np.asarray(list(values), np.float64)
  if v.size == 0:
    raise ValueError("spread of no values")
  p25, med, p75 = np.percentile(v, [25, 50, 75])
  return {"median": float(med), "p25": float(p25), "p75": float(p75), "min": float(v.min()),
          "max": float(v.max()), "n": int(v.size)}


def fmt(x: Any, digits: int = 3, suffix: str = "") -> str:
  """A table cell: numbers rounded, None/NaN as 'n/a', strings as they are."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "n/a"
  if isinstance(x, (bool, np.bool_)):
    return "yes" if x else "no"
  if isinstance(x, (int, np.integer)):
    return f"{int(x)}{suffix}"
  if isinstance(x, (float, np.floating)):
    return f"{float(x):.{digits}f}{suffix}"
  return str(x)


def fmt_spread(s: Mapping[str, float] | None, *, scale: float = 1.0, digits: int = 3) -> str:
  """'median [p25, p75]' of a `spread` dict, values multiplied by scale (1e3: ms)."""
  if s is None:
    return "n/a"
  return (f"{s['median'] * scale:.{digits}f} [{s['p25'] * scale:.{digits}f}, "
          f"{s['p75'] * scale:.{digits}f}]")


def parse_ints(text: str, name: str) -> tuple[int, ...]:
  """'1-10' or '1,4,16' (or a mix, '1-3,8') -> a tuple of positive ints."""
  out: list[int] = []
  try:
    for part in str(text).split(","):
      part = part.strip()
      if "-" in part:
        lo, hi = (int(p) for p in part.split("-", 1))
        out.extend(range(lo, hi + 1))
      elif part:
        out.append(int(part))
  except ValueError as e:
    raise ValueError(f"--{name} must be ints or ranges like '1-10' or '1,4,16', "
                     f"got {text!r}") from e
  if not out or min(out) < 1:
    raise ValueError(f"--{name} must list ints >= 1, got {text!r}")
  return tuple(out)


def parse_floats(text: str, name: str) -> tuple[float, ...]:
  try:
    out = tuple(float(p) for p in str(text).split(",") if p.strip())
  except ValueError as e:
    raise ValueError(f"--{name} must be comma-separated numbers, got {text!r}") from e
  if not out:
    raise ValueError(f"--{name} is empty")
  return out


# ------------------------------------------------------------------ result files
@dataclasses.dataclass(frozen=True)
class Column:
  """A table column: the row key, its header, and how a cell is shown in markdown."""
  key: str
  header: str
  show: Callable[[Any], str] = fmt


def to_jsonable(x: Any) -> Any:
  if isinstance(x, Mapping):
    return {str(k): to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_jsonable(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def markdown_table(columns: Sequence[Column], rows: Sequence[Mapping[str, Any]]) -> str:
  head = "| " + " | ".join(c.header for c in columns) + " |"
  rule = "|" + "---|" * len(columns)
  body = ["| " + " | ".join(c.show(r.get(c.key)) for c in columns) + " |" for r in rows]
  return "\n".join([head, rule, *body]) + "\n"


def write_outputs(results_dir: str, stem: str, *, title: str, columns: Sequence[Column],
                  rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any],
                  notes: Sequence[str] = (), extra_md: str = "",
                  extra: Mapping[str, Any] | None = None,
                  readme_table: tuple[Sequence[Column], Sequence[Mapping[str, Any]]] | None
                  = None) -> dict[str, str]:
  """Writes stem.md, stem.csv and stem.json; returns their paths by extension.

  extra: more top-level JSON entries (e.g. a driver's scalar summary).
  readme_table: (columns, rows) of a shorter table for the README section; the
  JSON then also holds "readme_markdown" (same header, notes and extra_md).
  """
  os.makedirs(results_dir, exist_ok=True)
  paths = {ext: os.path.join(results_dir, f"{stem}.{ext}") for ext in ("md", "csv", "json")}
  m = meta["machine"]
  lines = [f"# {title}", "", f"Command: `{meta['command']}`", "",
           f"Machine: {machine_line(m)}", "", f"Date: {m['date']}"
           + (f" (commit {m['git_commit']})" if m.get("git_commit") else ""), ""]
  lines += [f"- {n}" for n in notes]
  head = "\n".join(lines) + ("\n\n" if notes else "\n")
  tail = "\n" + extra_md.rstrip("\n") + "\n" if extra_md else ""
  text = head + markdown_table(columns, rows) + tail
  if readme_table is not None:
    extra = dict(extra or {}, readme_markdown=head + markdown_table(*readme_table) + tail)
  with open(paths["md"], "w", encoding="utf-8") as f:
    f.write(text)
  keys = [c.key for c in columns]
  keys += sorted({k for r in rows for k in r} - set(keys))
  with open(paths["csv"], "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(keys)
    for r in rows:
      writer.writerow([_csv_cell(r.get(k)) for k in keys])
  with open(paths["json"], "w", encoding="utf-8") as f:
    json.dump(to_jsonable({"meta": meta, "title": title, "columns": keys, "rows": list(rows),
                           "notes": list(notes), "markdown": text, **(extra or {})}), f,
              indent=2,
              allow_nan=True)
    f.write("\n")
  return paths


def _csv_cell(x: Any) -> Any:
  if isinstance(x, (dict, list, tuple)):
    return json.dumps(to_jsonable(x))
  return "" if x is None else x


def new_meta(module: str, argv: Sequence[str], **settings) -> dict[str, Any]:
  return {"command": command_line(module, argv), "machine": machine(),
          "settings": to_jsonable(settings), "python": sys.version.split()[0]}
