"""The one harness of every experiment driver under experiments/.

  models      load_models: a target and any named drafts (a pair, or a decoder set: draft
              models and heads), each a `ModelSpec` or a --target/--draft string
              (`model_spec`: demo:NAME, a T5 preset, a checkpoint path)
  inputs      task_inputs / random_encoder_tokens, batches; setups' runs: setup_batches
  decoding    decode_fn: one decoder on a batch; time_decodes: every decoder over every
              batch in interleaved rounds (compiled first), returning the rounds' seconds,
              each call's fastest seconds and the last round's outputs
  statistics  decode_stats: a decoder's acceptance statistics and identity with the
              baseline, from the runner's report (`experiment.report.acceptance_summary`)
  step costs  the library's (`experiment.measure.step_costs`: c and the marginal step
              cost have one definition)
  main        one skeleton: parse the arguments, run, write the result files, print them

Each driver writes `<results_dir>/<stem>.md` (a title, the exact command, the
machine, the date, notes and a markdown table), `<stem>.csv` (the same rows,
raw numbers) and `<stem>.json` ({"meta", "columns", "rows", "notes"}), so a
README section can be regenerated from the JSON files (`results_readme.py`).
Gin-configured runs (every row of the paper tables) go through `setups`.
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

from spec_decode.decoding.timing import spread  # noqa: F401  (the drivers' statistics)

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
  """SPEC_DECODE_COMMIT when set (a copy of the tree sent to another machine, whose git
  history, if any, is not the tree's), else the checkout's short commit."""
  if os.environ.get("SPEC_DECODE_COMMIT"):
    return os.environ["SPEC_DECODE_COMMIT"]
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


def machine_line(m: Mapping[str, Any], *, decoding: bool = True) -> str:
  """One line for a table header, e.g. '2 cores of Intel Xeon ..., jax 0.10.2 (cpu: 1 x cpu)',
  then (decoding=True) the decode kernel's line (CPU features, weight formats, variants) when
  recorded."""
  line = (f"{m['nproc']} cores of {m['cpu_model']}, jax {m['jax']} "
          f"({m['backend']}: {m['devices']}), load average {m['load_average_1m']} at start")
  if m.get("load_average_1m_end") is not None:
    line += f", {m['load_average_1m_end']} at end"
  if decoding and m.get("decoding"):
    from spec_decode.experiment import report
    line += f"; {report.machine_line(m['decoding'])}"
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
  """Adds the end-of-run load average (contention during the measurement) and how the
  decoders ran (`experiment.report.machine`: on CPU the features and the decode kernel's
  weight formats and variants)."""
  from spec_decode.experiment import report
  meta["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
  meta["machine"]["decoding"] = report.machine()
  return meta


# ------------------------------------------------------------------ statistics
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


def parse_gammas(p, args) -> None:
  """args.gammas (a '1,3,5' list) -> sorted distinct ints >= 1 (a usage error otherwise)."""
  try:
    args.gammas = sorted(set(parse_ints(args.gammas, "gammas")))
  except ValueError as e:
    p.error(str(e))


def parse_gammas_in_cache(p, args) -> None:
  """`parse_gammas`, and a check that --position leaves every gamma + 1 tokens room in
  --cache_length (a usage error otherwise): the proposal-in-the-loop drivers' arguments."""
  parse_gammas(p, args)
  if not 0 <= args.position <= args.cache_length - max(args.gammas) - 1:
    p.error(f"--position must lie in [0, cache_length - max(gammas) - 1], got "
            f"{args.position}")


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


# ------------------------------------------------------------------ models
def model_spec(text: str, *, config: str | None = None, dtype: str | None = None,
               seed: int = 0, vocab_size: int | None = None, role: str = "target"):
  """The ModelSpec of a --target/--draft argument: demo:<name> (a shipped demo model, a
  draft head included), a T5 preset (random weights, `config` JSON overrides) or a
  checkpoint path."""
  from spec_decode.experiment.model_specs import ModelSpec
  from spec_decode.models import t5
  overrides = json.loads(config) if config else {}
  if not isinstance(overrides, dict):
    raise ValueError(f"--{role}_config must be a JSON object, got {config!r}")
  if text.startswith("demo:"):
    name = text[len("demo:"):]
    path = os.path.join(DEMO_DIR, name)
    kind = next((k for k in _head_kinds() if os.path.exists(os.path.join(path,
                                                                           f"{k}_config.json"))
                 or (k == "medusa" and os.path.exists(os.path.join(path, "medusa.json")))),
                "t5")
    return ModelSpec(kind=kind, checkpoint=path,
                     dtype=dtype if kind == "t5" else dtype or "float32", name=f"demo {name}")
  if text in t5.PRESETS:
    if vocab_size:
      overrides.setdefault("vocab_size", vocab_size)
    shown = {k: v for k, v in overrides.items() if k != "vocab_size"}
    return ModelSpec(preset=text, config=overrides, dtype=dtype, seed=seed,
                     name=f"{text}{' ' + json.dumps(shown) if shown else ''} (random)")
  if overrides:
    raise ValueError(f"--{role}_config applies to presets only, not to checkpoint {text!r}")
  return ModelSpec(checkpoint=text, dtype=dtype)


def _head_kinds() -> tuple[str, ...]:
  import spec_decode.heads  # noqa: F401  (registers the kinds)
  from spec_decode.checkpoints import heads as head_checkpoints
  return head_checkpoints.kinds()


@dataclasses.dataclass(frozen=True)
class Models:
  """A target and named drafts: drafts[name] = (model, params); specs[name] its ModelSpec
  ('target' for the target)."""
  target: Any
  target_params: Any
  drafts: Mapping[str, tuple[Any, Any]]
  specs: Mapping[str, Any]

  def draft(self, name: str) -> tuple[Any, Any]:
    return self.drafts[name]


def load_models(target, drafts: Mapping[str, Any] | None = None, *, mesh=None) -> Models:
  """Loads the target and each named draft (a ModelSpec, or a string for `model_spec`),
  through the runner's loader (`experiment.model_specs.load`)."""
  from spec_decode.experiment.model_specs import LoadContext, ModelSpec, load
  as_spec = lambda x, role, seed: x if isinstance(x, ModelSpec) else model_spec(
      x, seed=seed, role=role)
  tspec = as_spec(target, "target", 0)
  model, params = load(tspec, LoadContext("target", mesh=mesh))
  out, specs = {}, {"target": tspec}
  for name, d in (drafts or {}).items():
    spec = as_spec(d, "draft", 1)
    out[name] = load(spec, LoadContext("draft", vocab_size=model.vocab_size, mesh=mesh))
    specs[name] = spec
  return Models(model, params, out, specs)


# ------------------------------------------------------------------ inputs
DEMO_DIR = os.environ.get("SPEC_DECODE_DEMO_MODELS", os.path.join(REPO_ROOT, "demo_models"))


def task_inputs(task: str, *, split: str, num_examples: int, input_length: int,
                decode_len: int) -> np.ndarray:
  """[num_examples, input_length] encoder ids of a task's first examples."""
  from spec_decode import data
  examples = data.load_examples(data.get_task(task), split=split, num_examples=num_examples,
                                feature_lengths={"inputs": input_length, "targets": decode_len})
  return np.concatenate([data.encoder_batch([ex], batch_size=1, input_length=input_length)
                         for ex in examples])


def random_encoder_tokens(batch: int, length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
  """[batch, length] ids in [2, vocab_size) (no PAD, no EOS): a stand-in input."""
  rng = np.random.default_rng(seed)
  return rng.integers(2, vocab_size, size=(batch, length)).astype(np.int32)


def batches(inputs: np.ndarray, batch_size: int) -> tuple[list[tuple[Any, Any]], int]:
  """([(encoder tokens [B, S], row ids [B])], rows): consecutive batches of `inputs`, the
  last padded by repeating its last row (`experiment.batching`), row ids the row indices."""
  import jax.numpy as jnp

  from spec_decode.experiment import batching
  out = []
  for i, (enc, _) in enumerate(batching.batches(inputs, batch_size)):
    ids = batching.pad_rows(np.arange(i * batch_size, min(len(inputs), (i + 1) * batch_size),
                                      dtype=np.int32), batch_size)
    out.append((jnp.asarray(enc), jnp.asarray(ids)))
  return out, len(inputs)


def setup_batches(s, *, per_call: bool = False) -> tuple[list[tuple[Any, Any]], int]:
  """The batches of a loaded experiment (`experiment.Setup`): its examples in batches of its
  batch size (the slots of a refilled run), row ids the example indices; per_call: in the
  inputs of its decode calls instead (with refill, `refill_chunk` batches' worth each)."""
  from spec_decode.experiment import setup as run_setup
  examples = list(s.examples)
  B = run_setup.call_rows(s) if per_call else s.config.batch_size
  return [run_setup.inputs(s, examples[i:i + B], rows=B)
          for i in range(0, len(examples), B)], len(examples)


# ------------------------------------------------------------------ decoding
def decode_fn(algorithm, target, target_params, draft=None, draft_params=None,
              **common) -> Callable[[Any, Any], Any]:
  """(encoder tokens, row ids) -> DecodeResult of `algorithm` (`decoding.run` with `common`:
  max_decode_len, sampling, rng, mesh, compiler_options, ...)."""
  from spec_decode import decoding
  drafts = dict(draft=draft, draft_params=draft_params) if algorithm.needs_draft else {}
  return lambda enc, ids: decoding.run(algorithm, target, target_params, enc, row_ids=ids,
                                       **drafts, **common)


@dataclasses.dataclass
class Timings:
  """One decoder's end-to-end times: seconds [rounds] (all batches, each round);
  call_seconds [batches] (each batch's fastest call); outputs: the last round's results."""
  seconds: list[float]
  call_seconds: list[float]
  outputs: list


class ProgramsDoNotFit(RuntimeError):
  """The decoders of one `time_decodes` call need more compiled programs than the process
  keeps (`decoding.footprint.before_compile` drops them all when the memory maps are
  crowded), so timed calls would include compiles."""


def time_decodes(fns: Mapping[str, Callable[[Any, Any], Any]], batches: Sequence, *,
                 repeats: int, target=None, on_round: Callable[[int], None] | None = None
                 ) -> dict[str, Timings]:
  """Every decoder over every batch, `repeats` rounds, decoders interleaved within a round
  (the machine's drifts hit them alike; a decoder listed right after the baseline is timed
  right after it). Each decoder is compiled first, on one batch of each input shape the
  unsharded runner compiles `target` for (`runner.compiled_shape`; without a target, or
  for sharded decoders: the first batch), so no timed call compiles. on_round(r) is called
  after round r.

  When the process drops its compiled programs during the warm-up (`footprint.releases`:
  the memory maps were crowded as a later decoder compiled), every decoder is compiled
  again, once; a drop during the second warm-up or during a round means the programs do
  not fit together, and the timings would include compiles: ProgramsDoNotFit, naming the
  program count and the memory maps in use."""
  import jax

  from spec_decode.decoding import footprint, runner, timing
  warm = {}
  for enc, ids in batches:
    key = None if target is None else runner.compiled_shape(target, enc)
    warm.setdefault(key, (enc, ids))

  def warm_up():
    for f in fns.values():
      for enc, ids in warm.values():
        jax.block_until_ready(f(enc, ids))

  def check(released: int, when: str) -> None:
    if footprint.releases() != released:
      use = footprint.memory_map_use() or ("?", "?")
      raise ProgramsDoNotFit(
          f"{len(fns)} decoders x {len(warm)} input lengths = {len(fns) * len(warm)} compiled "
          f"programs do not fit together: the process dropped them {when} (memory maps "
          f"crowded, {use[0]} of {use[1]} in use now; footprint.before_compile), so timed "
          "calls would include compiles; time fewer decoders per run")

  before = footprint.releases()
  warm_up()
  warmed = footprint.releases()
  footprint.warm_again_if_released(before, warm_up)
  check(warmed, "again while they compiled")  # a second warm-up that lost programs too
  out = {name: Timings([], [math.inf] * len(batches), []) for name in fns}
  for r in range(repeats):
    for name, f in fns.items():
      total, outs = 0.0, []
      for b, (enc, ids) in enumerate(batches):
        t = timing.timed(lambda: f(enc, ids))
        total += t.seconds[0]
        out[name].call_seconds[b] = min(out[name].call_seconds[b], t.seconds[0])
        outs.append(t.result)
      out[name].seconds.append(total)
      out[name].outputs = outs
    check(warmed, f"in timed round {r + 1}")
    if on_round is not None:
      on_round(r)
  return out


# ------------------------------------------------------------------ statistics
def rows_of(outputs: Sequence, n_rows: int) -> list[dict]:
  """Per-row {tokens, length, stats} of a decoder's batch results (the first n_rows rows;
  the last batch may repeat its last row), as the runner's prediction rows keep them."""
  from spec_decode import data
  from spec_decode.experiment import report
  rows = []
  for res in outputs:
    toks, lens = np.asarray(res.tokens), np.asarray(res.lengths)
    for r in range(toks.shape[0]):
      rows.append({"tokens": data.output_tokens(toks[r], lens[r]), "length": int(lens[r]),
                   "stats": report.row_stats(res.stats, r)})
  return rows[:n_rows]


def setup_charged_speedup(*, ar_seconds: float, tokens: float, target_calls: float,
                          target_step: float, iteration_steps: float,
                          setup: float | None = None, draft_setup: float = 0.0
                          ) -> float | None:
  """`experiment.measure.model_work_speedup` of a run from its own autoregressive seconds.

  Without `setup` (a run that did not time its set-up): the set-up both decoders pay
  (encoding, cross-attention caches, each call's fixed cost) is estimated as the
  autoregressive seconds less tokens x T_p (target_step); the speculative decoder then pays
  it plus target_calls x iteration_steps x T_p (iteration_steps = gamma c + T_verify(gamma +
  1) / T_p). That estimate takes T_p from a timing loop run at another moment than the
  decode: on a machine whose speed drifts, a T_p timed slow leaves no set-up at all.
  With the set-up measured (`setup`, the target's; `draft_setup`, the draft model's): the
  step is the autoregressive decode's own, (ar_seconds - setup) / tokens (T_p where that is
  not positive), and only the ratios c and T_verify / T_p come from the timing loops: the
  speculative decoder pays setup + draft_setup + target_calls x iteration_steps x that step.
  Totals or per-example means alike; None without calls."""
  from spec_decode.experiment import measure
  if not target_calls or not target_step or not iteration_steps or not tokens:
    return None
  if setup is None:
    setup, step = max(ar_seconds - tokens * target_step, 0.0), target_step
  else:
    step = (ar_seconds - setup) / tokens
    step = step if step > 0 else target_step
  return measure.model_work_speedup(
      target_setup=[setup], draft_setup=[draft_setup], target_step=step,
      ar_iterations=[tokens], spec_iteration=iteration_steps * step,
      spec_iterations=[target_calls])


def decode_stats(outputs: Sequence, n_rows: int, baseline: Sequence | None = None
                 ) -> dict[str, Any]:
  """A decoder's statistics over its rows: the report's acceptance summary (alpha, observed
  acceptance, tokens per target call, drafted per call, per-position acceptance; nothing
  for the baseline), tokens, target calls and, given the baseline's outputs, the fraction
  of rows identical to it."""
  from spec_decode import metrics
  from spec_decode.experiment import report
  rows = rows_of(outputs, n_rows)
  d = report.acceptance_summary([r["stats"] for r in rows], [r["length"] for r in rows])
  d["tokens"] = float(sum(r["length"] for r in rows))
  d["target_calls"] = int(sum(r["stats"]["target_calls"] for r in rows))
  d.setdefault("tokens_per_target_call", d["tokens"] / d["target_calls"]
               if d["target_calls"] else math.nan)
  if baseline is not None:
    d["identical"] = metrics.identical_fraction(
        [r["tokens"] for r in rows_of(baseline, n_rows)], [r["tokens"] for r in rows])
  return d


# ------------------------------------------------------------------ main
@dataclasses.dataclass(frozen=True)
class Output:
  """What a driver writes (`write_outputs`): <results_dir>/<stem>.{md,csv,json}."""
  stem: str
  title: str
  columns: Sequence[Column]
  rows: Sequence[Mapping[str, Any]]
  notes: Sequence[str] = ()
  extra_md: str = ""
  extra: Mapping[str, Any] | None = None
  readme_table: tuple | None = None
  figures: Sequence[str] = ()


TRACEBACK_ENV = "SPEC_DECODE_TRACEBACK"


def cli_errors(module: str):
  """Run from the command line (`python -m experiments.X`), a driver ends a known error --
  bad input the user can fix: a ValueError such as a bad --gammas list, a missing file, a
  corrupt checkpoint, out of memory -- with one line on stderr and exit code 2, as
  `spec_decode.main` does; SPEC_DECODE_TRACEBACK=1 shows the traceback instead. Called
  with an argv (tests, notebooks), drivers raise as any function does."""
  from spec_decode.cli import errors
  return errors.handle_errors(f"python -m {module}",
                              verbose=os.environ.get(TRACEBACK_ENV, "") not in ("", "0"),
                              hint=f"{TRACEBACK_ENV}=1 shows the traceback")


def main(module: str, argv: Sequence[str] | None, parse_args: Callable[[Sequence[str]], Any],
         run: Callable[[Any, dict], Output | Sequence[Output]], *,
         private: Sequence[str] = ("results_dir",)) -> dict[str, Any]:
  """Every driver's main: parse argv (default sys.argv[1:]), record the command and machine,
  run(args, meta) -> Output (or several), record the end load, write and print the result
  files. Returns their paths by extension (figures as png_<i>), or {stem: paths} for
  several outputs. private: argument names left out of the recorded settings (where files
  go)."""
  if argv is None:  # the command line: a known error ends in one line (`cli_errors`)
    from spec_decode import compile_cache
    compile_cache.enable()  # a command's programs persist between runs; calls leave jax as is
    with cli_errors(module):
      return main(module, sys.argv[1:], parse_args, run, private=private)
  argv = list(argv)
  args = parse_args(argv)
  meta = new_meta(module, argv, **{k: v for k, v in vars(args).items() if k not in private})
  outs = run(args, meta)
  finish_meta(meta)
  written = {out.stem: _write(args.results_dir, out, meta)
             for out in ([outs] if isinstance(outs, Output) else outs)}
  return next(iter(written.values())) if isinstance(outs, Output) else written


def _write(results_dir: str, out: Output, meta: Mapping[str, Any]) -> dict[str, str]:
  extra_md = out.extra_md + "".join(f"![{os.path.basename(f)}]({os.path.basename(f)})\n"
                                    for f in out.figures)
  extra = dict(out.extra or {})
  if out.figures:
    extra["figures"] = [os.path.basename(f) for f in out.figures]
  paths = write_outputs(results_dir, out.stem, title=out.title, columns=out.columns,
                        rows=out.rows, meta=meta, notes=out.notes, extra_md=extra_md,
                        extra=extra or None, readme_table=out.readme_table)
  print(open(paths["md"], encoding="utf-8").read())
  paths.update({f"png_{i}": f for i, f in enumerate(out.figures)})
  return paths
