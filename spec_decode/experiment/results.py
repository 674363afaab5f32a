"""An experiment's output directory: rows appended per batch, resumable, and the summaries.

  predictions.jsonl  one JSON object per example, keyed by "index"; a batch's
                     rows are appended in one write and fsync'ed, so a killed
                     run loses at most the batch in flight
  config.json        the experiment's settings; a rerun must match them
  progress.json      completed / total examples (informational)
  results.json       final metrics, computed from all rows of predictions.jsonl
  table_row.md       the paper's Table 4 header and this run's row
  runs.json          one entry per run that decoded rows: its id, host, user,
                     devices and step-time measurements (c), so timings of
                     different runs are reported side by side, never mixed silently
  .lock              held (fcntl) by the run writing here; a second run is refused

`read_rows` drops a partial last line (a write cut by a kill) from the file,
so appending continues on a clean line boundary; a duplicated index or a row
missing fields the others have is an error (the file was written by two runs
at once, or edited).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import socket
import tempfile
import time
from typing import Any, Iterable, Mapping

PREDICTIONS = "predictions.jsonl"
CONFIG = "config.json"
PROGRESS = "progress.json"
RESULTS = "results.json"
TABLE_ROW = "table_row.md"
RUNS = "runs.json"
GAMMA = "gamma.json"  # the gamma chosen from warm-up measurements (experiment.gamma)
LOCK = ".lock"


class OutputDirError(ValueError):
  """The output directory cannot be used (a file, not writable, or in use by another run)."""


def check_output_dir(output_dir: str) -> None:
  """Raises OutputDirError unless output_dir is (or can be made) a writable directory.

  Cheap, so the command line calls it before loading any model.
  """
  if not output_dir:
    raise OutputDirError("output_dir is empty; pass --output_dir=DIR")
  path = os.path.abspath(output_dir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputDirError(f"output_dir {path} is a file, not a directory; pass a directory "
                         "(new or from an earlier run of the same experiment)")
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise OutputDirError(f"output_dir {path} cannot be created: {parent} is a file")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise OutputDirError(f"output_dir {path} is not writable ({parent} denies writing); "
                         "pass another --output_dir")


def read_rows(path: str) -> dict[int, dict]:
  """{index: row} of a predictions file (empty if absent).

  Every row must have the keys the first row has, and no index may repeat:
  either means the file was written by two runs at once or edited by hand,
  and no rule picks the right row, so it is an error naming the line.
  """
  if not os.path.exists(path):
    return {}
  with open(path, "rb") as f:
    data = f.read()
  complete = data.rfind(b"\n") + 1
  rows: dict[int, dict] = {}
  lines: dict[int, int] = {}
  keys = None
  for lineno, line in enumerate(data[:complete].splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      index = row["index"]
      if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"index {index!r} is not an int >= 0")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
      why = ("no index" if isinstance(e, KeyError) else
             "nested too deeply" if isinstance(e, RecursionError) else
             f"{type(e).__name__}: {str(e)[:200]}")
      raise ValueError(f"{path}:{lineno} is not a prediction row ({why}): {line[:200]!r}; "
                       "remove the line (or use a new output_dir)") from e
    if index in rows:
      raise ValueError(f"{path}:{lineno} repeats example index {index} of line "
                       f"{lines[index]} (two runs wrote here at once, or the file was "
                       "edited); keep one of the lines, or use a new output_dir")
    keys = set(row) if keys is None else keys
    if set(row) != keys:
      missing, extra = sorted(keys - set(row)), sorted(set(row) - keys)
      raise ValueError(f"{path}:{lineno} (index {index}) does not have the fields of the "
                       f"other rows (missing {missing}, extra {extra}); it was written by "
                       "another version or edited: remove it to decode it again, or use a "
                       "new output_dir")
    rows[index], lines[index] = row, lineno
  if complete < len(data):
    with open(path, "r+b") as f:
      f.truncate(complete)
  return rows


_REDO = "delete it (the run redoes what it recorded) or use a new output_dir"


def read_state_json(path: str, what: str, fix: str = _REDO) -> dict:
  """A JSON object this project wrote into an output directory (config.json, runs.json,
  gamma.json), or an OutputDirError naming the file when it is not one (truncated by a
  full disk, edited by hand, another program's file), with `fix`, what to do about it."""
  try:
    with open(path, encoding="utf-8") as f:
      obj = json.load(f)
  except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError included
    raise OutputDirError(f"{path} ({what}) is corrupt: {type(e).__name__}: {e}; "
                         f"{fix}") from None
  if not isinstance(obj, dict):
    raise OutputDirError(f"{path} ({what}) is corrupt: expected a JSON object, got "
                         f"{type(obj).__name__}; {fix}")
  return obj


def _open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
  """os.open that refuses a symbolic link at `path` (a link planted in an output directory
  would have this run write through it into a file elsewhere)."""
  try:
    return os.open(path, flags | os.O_NOFOLLOW, mode)
  except OSError:
    if os.path.islink(path):
      raise OutputDirError(f"{path} is a symbolic link (to {os.readlink(path)!r}); a run "
                           "writes only files of its own there: remove the link, or pass "
                           "another --output_dir") from None
    raise


def append_rows(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
  """Appends rows as JSON lines in one write, flushed and fsync'ed."""
  text = "".join(json.dumps(dict(r), sort_keys=True, allow_nan=True) + "\n" for r in rows)
  if not text:
    return
  fd = _open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
  with _naming(path), open(fd, "a", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def _naming(path: str):
  """An OSError of a write (a full disk: ENOSPC; a file-size limit: EFBIG) names `path`,
  which the bare write error does not."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, path) from e


def write_json(path: str, obj: Any) -> None:
  """Writes obj as JSON atomically (a new temporary file, then rename)."""
  write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n")


def write_text(path: str, text: str) -> None:
  """Writes text atomically: into a temporary file this call creates (a random name,
  O_EXCL, so nothing planted under the name is written through), then renamed over path
  (which replaces a link at path, never its target)."""
  directory, name = os.path.split(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
  try:
    with _naming(path), open(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def check_config(output_dir: str, config: Mapping[str, Any], *,
                 may_differ: Iterable[str] = ()) -> None:
  """Records `config` in output_dir, or checks that a previous run there used the same one.

  Keys in `may_differ` may change between runs (e.g. num_examples: a rerun
  with more examples extends the same predictions).
  """
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, CONFIG)
  config = json.loads(json.dumps(dict(config), sort_keys=True))
  start_over = ("what was decoded or chosen there cannot be resumed under unknown settings: "
                "use a new output_dir, or empty this one to start over")
  if os.path.exists(path):
    previous = read_state_json(path, "the settings of the runs that wrote here",
                               fix=f"{PREDICTIONS} and {GAMMA} were made with the settings "
                                   f"it held; {start_over}")
    skip = set(may_differ)
    old = _dotted({k: v for k, v in previous.items() if k not in skip})
    new = _dotted({k: v for k, v in config.items() if k not in skip})
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
      detail = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
      raise ValueError(f"{output_dir} holds a run of a different experiment ({detail}); "
                       f"use a new output_dir or restore the settings to resume")
  else:
    # Rows or a gamma choice without the settings that made them (config.json deleted):
    # resuming would mix them with whatever settings this run has, and the results too.
    predictions = os.path.join(output_dir, PREDICTIONS)
    made = [name for name, there in (
        (PREDICTIONS, os.path.exists(predictions) and os.path.getsize(predictions) > 0),
        (GAMMA, os.path.exists(os.path.join(output_dir, GAMMA)))) if there]
    if made:
      raise OutputDirError(f"{output_dir} has {' and '.join(made)} but no {CONFIG}, which "
                           f"records the settings they were made with; {start_over}")
  write_json(path, config)


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{dotted key: leaf} of nested dicts (a changed decoder's gamma reads
  'decoders.speculative.gamma')."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping) and v:
      out.update(_dotted(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


# ---------------------------------------------------------------- one run at a time
@contextlib.contextmanager
def locked(output_dir: str, *, enabled: bool = True):
  """Holds output_dir/.lock (an exclusive fcntl lock) for the duration of a run.

  A second run into the same directory fails at once with OutputDirError
  naming the pid and host holding the lock. The lock dies with its process
  (kill -9 included), so a stale lock file never blocks a rerun. If this run
  created output_dir and wrote nothing else there, the directory is removed
  again, so a run that fails early leaves no trace.
  """
  if not enabled:
    yield
    return
  check_output_dir(output_dir)
  created = not os.path.exists(output_dir)
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, LOCK)
  while True:
    fd = _open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
      os.close(fd)
      raise OutputDirError(f"output_dir {output_dir} is in use by another run ({holder}); "
                           "wait for it to finish or pass another --output_dir") from None
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)  # the file was replaced between open and lock: lock the new one
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, user {_user()}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
  try:
    yield
  finally:
    if created and os.listdir(output_dir) == [LOCK]:
      os.unlink(path)
      os.rmdir(output_dir)
    os.close(fd)  # releases the lock


def _user() -> str:
  try:
    return getpass.getuser()
  except Exception:  # no user name in some containers
    return str(os.getuid())


# ---------------------------------------------------------------- runs and their timings
def run_id_of(row: Mapping[str, Any]) -> str:
  """The id of the run that decoded a row (rows carry 'batch' = '<run id>:<batch>')."""
  return str(row.get("batch", "")).split(":", 1)[0]


def read_runs(output_dir: str) -> dict[str, dict]:
  path = os.path.join(output_dir, RUNS)
  if not os.path.exists(path):
    return {}
  return read_state_json(path, "the runs that wrote here and their timings")


def record_run(output_dir: str, run_id: str, info: Mapping[str, Any]) -> None:
  """Adds (or updates) run `run_id` in runs.json, with host, user and `info`."""
  runs = read_runs(output_dir)
  runs[run_id] = dict(runs.get(run_id, {}), host=socket.gethostname(), user=_user(),
                      finished=time.strftime("%Y-%m-%d %H:%M:%S"), recorded=time.time(),
                      **info)
  write_json(os.path.join(output_dir, RUNS), runs)


BASELINE = "autoregressive"  # the decoder every speedup is measured against


def timing_by_run(rows: Mapping[int, Mapping[str, Any]],
                  runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
  """Per run that decoded some of `rows`: its rows, its own decode seconds and speedup, its c.

  Each batch's baseline and decoder times are measured back to back in one run
  ('seconds' per decoder, 'speedups' against the baseline, 'speedup_measured' of
  the primary decoder), so a run's own speedup never mixes machines; the pooled
  speedup over several runs does, which is why they are listed separately.
  """
  out: dict[str, dict] = {}
  batches: dict[str, dict] = {}
  for row in rows.values():
    rid = run_id_of(row)
    entry = out.setdefault(rid, {"rows": 0})
    entry["rows"] += 1
    batches.setdefault(rid, {})[row.get("batch")] = row
  for rid, entry in out.items():
    seconds: dict[str, float] = {}
    for r in batches[rid].values():
      for name, d in r.get("decoders", {}).items():
        seconds[name] = seconds.get(name, 0.0) + float(d.get("batch_seconds", 0.0))
    entry["seconds"] = seconds
    base = seconds.get(BASELINE)
    if base is not None:
      entry["speedups"] = {n: (base / v if v > 0 else None) for n, v in seconds.items()
                           if n != BASELINE}
      # the first decoder after the baseline is the primary one (rows keep config order)
      entry["speedup_measured"] = next(iter(entry["speedups"].values()), None)
    info = runs.get(rid, {})
    for k in ("c", "host", "user", "devices", "finished"):
      if k in info:
        entry[k] = info[k]
  return out
