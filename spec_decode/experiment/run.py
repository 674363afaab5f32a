"""Running one experiment: every decoder on the same batches, rows appended, resumable.

  results = run_experiment(ExperimentConfig(...), output_dir="/tmp/ende_small")

Every decoder of the config (`experiment.config`) runs on the same batches with the
same sampling settings, PRNG key and row ids (the example indices, so a row's
randomness does not depend on its batch and a resumed run reproduces an uninterrupted
one). Each batch is timed after compilation (the first call of each decoder is timed on
its own and reported as compile time); `timing_repeats` > 1 takes the median of that
many runs per batch, the decoders taking turns. The step costs (T_p, each decoder's
proposal, c, the verify ratios) are measured after the rows, on one batch
(`experiment.measure`), and a gamma chosen from warm-up measurements before them
(`experiment.gamma`; gamma 0, the autoregressive loop, where those costs say speculation
cannot pay). Rows are appended to `predictions.jsonl` after every batch; a rerun with the
same output_dir skips the examples already there (refusing a changed config or a
checkpoint changed in place), and the summary (`results.json`, `table_row.md`, see
`experiment.report`) is always computed from all rows. See `experiment.results` for the files.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from spec_decode import data, distributed
from spec_decode.decoding import footprint, runner, timing
from spec_decode.experiment import (gamma, measure, model_specs, report, results,
                                    setup, status)
from spec_decode.experiment.config import ExperimentConfig



def _batch_rows(s: setup.Setup, batch: Sequence[data.Example], outputs: Mapping[str, Any],
                seconds: Mapping[str, float], batch_key: str) -> list[dict]:
  """One row per example: its inputs and target, and each decoder's output, tokens,
  length, counters and its batch's seconds (`outputs` maps decoder names to results)."""
  rows = []
  for r, ex in enumerate(batch):
    decoded = {}
    for name, res in outputs.items():
      tokens = data.output_tokens(np.asarray(res.tokens)[r], np.asarray(res.lengths)[r])
      decoded[name] = {"output": data.detokenize(s.vocabulary, tokens), "tokens": tokens,
                       "length": len(tokens), "batch_seconds": seconds[name],
                       "stats": report.row_stats(res.stats, r)}
    rows.append({"index": ex.index, "inputs": ex.inputs, "target": ex.targets,
                 "batch": batch_key, "batch_rows": len(batch), "decoders": decoded})
  return rows


def _decode_remaining(s: setup.Setup, todo: Sequence[data.Example], output_dir: str, *,
                      show_progress: bool, on_batch: Callable[[int], None] | None
                      ) -> dict[str, dict[str, float]]:
  """Decodes `todo` batch by batch, appending rows after each.

  Returns per decoder the first call's seconds (compilation + one run of the
  first batch) and the compile estimate: that minus the timed run of the batch.
  Unsharded decoders run the encoders on inputs trimmed to a few lengths
  (`decoding.runner.input_length`); every length's compile happens before the timed
  batches (one untimed call on its first batch).
  """
  cfg = s.config
  fns = setup.decode_fns(s)
  B = setup.call_rows(s)
  batches = [todo[i:i + B] for i in range(0, len(todo), B)]
  released = footprint.releases()
  first_call = {name: timing.timed(lambda f=f: f(*setup.inputs(s, batches[0]))).median
                for name, f in fns.items()}
  if s.mesh is None:
    _compile_input_lengths(s, fns, batches)

  def warm_up():  # untimed, every decoder and input length
    for f in fns.values():
      jax.block_until_ready(f(*setup.inputs(s, batches[0])))
    if s.mesh is None:
      _compile_input_lengths(s, fns, batches)

  # The process may have dropped its compiled programs while these compiled (a process
  # holding many: `footprint.before_compile`), the decoders warmed up first among them.
  footprint.warm_again_if_released(released, warm_up)
  run_id = uuid.uuid4().hex[:12]
  path = f"{output_dir}/{results.PREDICTIONS}"
  bar = None
  if show_progress:
    from tqdm import tqdm
    bar = tqdm(total=len(s.examples), initial=len(s.examples) - len(todo),
               desc=f"{cfg.task} {cfg.split}", unit="ex")
  compile_s = {}
  try:
    for b, batch in enumerate(batches):
      enc, ids = setup.inputs(s, batch)
      outputs, seconds = timing.timed_in_turns(
          {name: (lambda f=f: f(enc, ids)) for name, f in fns.items()}, cfg.timing_repeats)
      if b == 0:
        compile_s = {name: max(first_call[name] - seconds[name], 0.0) for name in fns}
      outputs = distributed.gather(outputs)  # every process joins; process 0 writes
      if setup.is_writer():
        results.append_rows(path, _batch_rows(s, batch, outputs, seconds, f"{run_id}:{b}"))
      if bar is not None:
        bar.update(len(batch))
      if on_batch is not None:
        on_batch(b)
  finally:
    if bar is not None:
      bar.close()
  return {"first_call_seconds": first_call, "compile_seconds": compile_s}


def _compile_input_lengths(s: setup.Setup, fns, batches) -> None:
  """One untimed call of every decoder on the first batch of each input shape (trimmed and
  packed length, `runner.compiled_shape`) after the first batch's, so that no timed batch
  includes a compile."""
  seen = {runner.compiled_shape(s.target, setup.inputs(s, batches[0])[0])}
  for batch in batches[1:]:
    enc, ids = setup.inputs(s, batch)
    n = runner.compiled_shape(s.target, enc)
    if n not in seen:
      seen.add(n)
      for f in fns.values():
        jax.block_until_ready(f(enc, ids))


def run_experiment(config: ExperimentConfig, *, output_dir: str, show_progress: bool = True,
                   on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
  """Runs (or resumes) `config` into output_dir and returns the results dict.

  on_batch(b) is called after batch b's rows are written (e.g. for logging).
  output_dir is locked for the run (`results.locked`): a second run into it
  fails at once. A rerun says "resuming K/N" or "already complete"; an already
  complete rerun decodes and measures nothing and reports the recorded step
  times; each run's own timings are listed in the results' 'runs'
  (`results.timing_by_run`).

  When it ends, compiled executables are dropped if the process holds many
  (`release_executables_if_crowded`), so a sweep of many experiments in one
  process cannot crash in a later compilation.
  """
  if not isinstance(config, ExperimentConfig):
    raise ValueError(f"config must be an ExperimentConfig, got {type(config).__name__}")
  try:
    with results.locked(output_dir, enabled=setup.is_writer()):
      return _run_experiment(config, output_dir=output_dir, show_progress=show_progress,
                             on_batch=on_batch)
  finally:
    footprint.release_executables_if_crowded()


def progress(message: str, *, enabled: bool) -> None:
  """A progress line on stderr (the results go to stdout)."""
  if enabled:
    print(f"[spec_decode] {message}", file=sys.stderr, flush=True)


def _run_experiment(config: ExperimentConfig, *, output_dir: str, show_progress: bool,
                    on_batch: Callable[[int], None] | None) -> dict[str, Any]:
  start = time.perf_counter()
  say = lambda msg: progress(msg, enabled=show_progress and setup.is_writer())
  s = setup.load(config, status=say)  # before anything is written: a failing config leaves no trace
  path = f"{output_dir}/{results.PREDICTIONS}"
  fingerprints = {}
  if setup.is_writer():
    # A checkpoint retrained in place must not resume the old model's predictions.
    fingerprints = {role: model_specs.checkpoint_fingerprint(getattr(config, role))
                    for role in ("target", "draft") if getattr(config, role) is not None}
    results.check_config(output_dir, dict(config.to_json(), checkpoint_fingerprints=fingerprints),
                         may_differ=("num_examples", "timing_repeats", "step_timing_repeats"))
  rows = results.read_rows(path) if setup.is_writer() else {}
  # process 0's view of the output directory decides
  done = np.asarray(setup.broadcast(np.array([ex.index in rows for ex in s.examples], bool)))
  todo = [ex for ex, d in zip(s.examples, done) if not d]
  resume = status.resume_state(len(s.examples), len(todo), path)
  say(resume["message"])
  old_runs = {results.run_id_of(r) for r in rows.values()}
  gamma_choice = None
  if config.gamma_choice is not None:
    gc = config.gamma_choice
    say(f"choosing gamma of decoder {gc.decoder} ({gc.rule}): measuring alpha, c"
        + (" and the verify costs" if gc.rule == "cost_model" else "")
        + f" on {gc.warmup_examples} warm-up examples"
        + (", then timing both decoders on them at the chosen gamma"
           if gc.times_warmup(config.baseline is not None) else ""))
    gamma_choice = gamma.choose_gamma(s, output_dir)
    if gamma_choice["gamma"] == 0:  # the measured costs say speculation cannot pay
      if "fallback" in gamma_choice:
        say(gamma_choice["fallback"])
      s = dataclasses.replace(s, config=config.without_speculation(gc.decoder))
    else:
      s = dataclasses.replace(s, config=config.with_gamma(gc.decoder, gamma_choice["gamma"]))
  compile_times = {}  # this run's; empty when nothing was left to decode
  if todo:
    say(f"compiling {'both decoders' if len(config.algorithms) == 2 else 'the decoders'} and "
        "warming up on the first batch, then decoding")
    compile_times = _decode_remaining(s, todo, output_dir, show_progress=show_progress,
                                      on_batch=on_batch)
  # Nothing decoded: report the step times measured with the rows (every process must
  # agree on measuring, so a multi-process run always measures).
  step_times = (status.recorded_step_times(output_dir)
                if not todo and jax.process_count() == 1 else None)
  remeasured = step_times is None and not todo  # rows complete, their step costs lost
  if step_times is None:
    say("measuring the step costs of the target and each decoder's proposal (c)")
    step_times = measure.measure_step_times(
        s, repeats=config.step_timing_repeats,
        in_loop=config.gamma_choice is not None and config.gamma_choice.in_loop_costs,
        example_setup=True)
  if not setup.is_writer():
    return {}
  rows = results.read_rows(path)
  new_runs = {results.run_id_of(r) for r in rows.values()} - old_runs
  for run_id in new_runs:
    results.record_run(output_dir, run_id, status.run_info(step_times))
  results.write_json(f"{output_dir}/{results.PROGRESS}",
                     {"completed": sum(ex.index in rows for ex in s.examples),
                      "total": len(s.examples)})
  summary = report.summarize(s.config, metric_fns=s.task.metric_fns, examples=s.examples,
                             rows=rows, step_times=step_times, compile_times=compile_times)
  summary["gamma_selection"] = gamma_choice
  summary["timing"]["run_seconds"] = time.perf_counter() - start
  summary.update(status.summary_extras(output_dir, rows, s.examples, config, resume))
  notice = model_specs.head_target_notice(config.draft, fingerprints.get("target"))
  if notice:
    summary["notices"].append(notice)
  if remeasured:
    summary["notices"].append(
        f"no step costs were recorded with these rows ({results.RUNS} missing or without "
        "them), so c, T_p and the predictions come from this run's measurement, not from "
        "the time the rows were timed")
  results.write_json(f"{output_dir}/{results.RESULTS}", summary)
  results.write_text(f"{output_dir}/{results.TABLE_ROW}",
                     report.TABLE_HEADER + summary["table_row"] + "\n")
  return summary
