"""One experiment: a target and a draft on N examples of a task, baseline vs speculative.

  results = run_experiment(ExperimentConfig(
      target=ModelSpec(checkpoint=".../t5_1_1_xxl"), draft=ModelSpec(checkpoint=".../small"),
      task="wmt_t2t_ende_v003", gamma=7), output_dir="/tmp/ende_small")

Both decoders run on the same batches with the same sampling settings, PRNG
key and row ids (the example indices, so a row's randomness does not depend on
its batch and a resumed run reproduces an uninterrupted one). Each batch is
timed after compilation (the first call of each decoder is timed on its own
and reported as compile time); `timing_repeats` > 1 takes the median of that
many runs per batch. c is measured in the same run as the median
single-token decode step of draft over target on one batch, timed inside a
jitted loop of several steps (`timing.step_time`). Rows are appended to
`predictions.jsonl` after every batch; a rerun with the same output_dir skips
the examples already there (refusing a changed config or a checkpoint changed
in place), and the summary (`results.json`, `table_row.md`, see
`spec_decode.report`) is always computed from all rows. See
`spec_decode.results` for the files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import (cli, data, decoding, distributed, model_specs, partitioning, report,
                         results, run_status, theory, timing)
from spec_decode.model_specs import LoadContext, ModelSpec



@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Settings of one experiment (everything but where its files go).

  target, draft: the models. task, split, num_examples (None = the whole
  split): the data; feature_lengths: seqio input/target lengths (inputs are
  cut to fit); max_decode_len: default feature_lengths['targets'].
  gamma, lenience: speculative decoding; gamma None picks it with
  theory.optimal_gamma (up to max_gamma) from alpha and c measured on the first
  gamma_warmup_examples examples (see `choose_gamma`); temperature, top_k, top_p: sampling,
  the same for both decoders (temperature 0 = greedy). seed: the PRNG key.
  run_baseline: also decode autoregressively (needed for the speedup).
  timing_repeats: timed runs per batch (median). step_timing_repeats: runs of
  each single-step measurement for c. logical_axis_rules: (logical, mesh axis)
  pairs placed before T5X's standard rules (so they override them), and
  parameter_partitioning_dims (1 or 2, as T5X): the target's layout on the mesh
  (the draft is replicated, its batch sharded). mesh: e.g. 'data=1,model=4' to shard
  over the local devices. vocabulary: SentencePiece model for T5's tasks
  instead of gs://t5-data's; tfds_data_dir: where TFDS data is prepared.
  """
  target: ModelSpec
  draft: ModelSpec
  task: str
  split: str = "validation"
  num_examples: int | None = 100
  batch_size: int = 1
  feature_lengths: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"inputs": 64, "targets": 64})
  max_decode_len: int | None = None
  gamma: int | None = 7
  gamma_warmup_examples: int = 4
  max_gamma: int = 10
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  lenience: float = 1.0
  seed: int = 0
  run_baseline: bool = True
  timing_repeats: int = 1
  step_timing_repeats: int = 10
  mesh: str | None = None
  logical_axis_rules: Sequence[tuple[str, Any]] = ()
  parameter_partitioning_dims: int = 1
  vocabulary: str | None = None
  tfds_data_dir: str | None = None

  def __post_init__(self):
    for role in ("target", "draft"):
      if not isinstance(getattr(self, role), ModelSpec):
        raise ValueError(f"ExperimentConfig.{role} must be a ModelSpec, got "
                         f"{type(getattr(self, role)).__name__}")
    if not isinstance(self.task, str) or not self.task:
      raise ValueError(f"ExperimentConfig.task must be a task name, got {self.task!r}")
    if self.gamma is not None and (not _is_int(self.gamma) or self.gamma < 1):
      raise ValueError(f"gamma must be an int >= 1 or None (chosen automatically), "
                       f"got {self.gamma!r}")
    for name in ("batch_size", "timing_repeats", "step_timing_repeats", "gamma_warmup_examples",
                 "max_gamma"):
      if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
        raise ValueError(f"ExperimentConfig.{name} must be an int >= 1, "
                         f"got {getattr(self, name)!r}")
    if self.num_examples is not None and (not _is_int(self.num_examples)
                                          or self.num_examples < 1):
      raise ValueError(f"num_examples must be an int >= 1 or None, got {self.num_examples!r}")
    object.__setattr__(self, "feature_lengths", data.check_feature_lengths(self.feature_lengths))
    if self.max_decode_len is not None and (not _is_int(self.max_decode_len)
                                            or self.max_decode_len < 1):
      raise ValueError(f"max_decode_len must be an int >= 1 or None, got {self.max_decode_len!r}")
    if not 0.0 < self.lenience <= 1.0:
      raise ValueError(f"lenience must be in (0, 1], got {self.lenience}")
    decoding.Sampling(temperature=float(self.temperature), top_k=self.top_k,
                      top_p=float(self.top_p))  # validates them

  @property
  def sampling(self) -> decoding.Sampling:
    return decoding.Sampling(temperature=float(self.temperature), top_k=self.top_k,
                             top_p=float(self.top_p))

  @property
  def decode_len(self) -> int:
    return self.max_decode_len or self.feature_lengths["targets"]

  def to_json(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["target"], d["draft"] = self.target.to_json(), self.draft.to_json()
    d["feature_lengths"] = dict(self.feature_lengths)
    d["logical_axis_rules"] = [list(r) for r in self.logical_axis_rules]
    return d

  @property
  def rules(self):
    """The target's logical axis rules (T5X's standard ones, overridden as configured)."""
    return partitioning.standard_logical_axis_rules(
        parameter_partitioning_dims=self.parameter_partitioning_dims,
        additional_rules=tuple(tuple(r) for r in self.logical_axis_rules))


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class _Setup:
  """Everything loaded for a run."""
  config: ExperimentConfig
  task: Any
  examples: tuple[data.Example, ...]
  target: Any
  target_params: Any
  draft: Any
  draft_params: Any
  mesh: Any

  @property
  def vocabulary(self):
    return self.task.output_features["targets"].vocabulary


def _is_writer() -> bool:
  """Only process 0 writes files (all processes decode)."""
  return jax.process_index() == 0


def setup(config: ExperimentConfig, *, status: Callable[[str], None] = lambda msg: None
          ) -> _Setup:
  """Resolves the task, examples, mesh and models (local checkpoint paths checked first).

  status(message) is told what is being loaded (the command line prints it).
  """
  for role in ("target", "draft"):
    model_specs.check_checkpoint(getattr(config, role), role)
  status(f"loading task {config.task} ({config.split}) and its examples")
  task = data.get_task(config.task, **({"vocabulary": config.vocabulary}
                                       if config.vocabulary else {}),
                       **({"tfds_data_dir": config.tfds_data_dir}
                          if config.tfds_data_dir else {}))
  examples = data.load_examples(task, split=config.split, num_examples=config.num_examples,
                                feature_lengths=config.feature_lengths)
  mesh = None
  if config.mesh:
    mesh = partitioning.make_mesh(config.mesh)
  elif jax.process_count() > 1:
    raise ValueError(f"a run over {jax.process_count()} processes needs a mesh over their "
                     "devices: set ExperimentConfig.mesh, e.g. 'data=-1,model=1'")
  status(f"loading the target model ({config.target.label})")
  target, tparams = model_specs.load(config.target, LoadContext("target", mesh=mesh))
  vocab_size = task.output_features["targets"].vocabulary.vocab_size
  if vocab_size > target.vocab_size:
    raise ValueError(f"task {config.task!r} has a vocabulary of {vocab_size} ids but the target "
                     f"model only {target.vocab_size}")
  data.check_token_ids(examples, target.vocab_size, what="target")  # jit would not notice

  def target_sequences(split: str, n: int | None) -> list[tuple[int, ...]]:
    exs = data.load_examples(task, split=split, num_examples=n,
                             feature_lengths=config.feature_lengths)
    return [ex.target_tokens for ex in exs]

  status(f"loading the draft model ({config.draft.label})")
  draft, dparams = model_specs.load(config.draft, LoadContext(
      "draft", vocab_size=target.vocab_size, mesh=mesh, target_sequences=target_sequences))
  if mesh is not None:  # the decoders' layouts: target by T5X's rules, draft replicated
    tparams = partitioning.put(tparams, partitioning.param_shardings(
        target, mesh, config.rules, params=tparams))
    dparams = partitioning.put(dparams, partitioning.param_shardings(
        draft, mesh, partitioning.data_parallel_rules(config.rules), params=dparams))
  return _Setup(config, task, tuple(examples), target, tparams, draft, dparams, mesh)


def _decoders(s: _Setup) -> dict[str, Callable[[jax.Array, jax.Array], decoding.DecodeResult]]:
  cfg = s.config
  common = dict(max_decode_len=cfg.decode_len, sampling=cfg.sampling,
                rng=jax.random.PRNGKey(cfg.seed))
  if s.mesh is not None:
    common.update(mesh=s.mesh, rules=cfg.rules)
  fns = {"speculative": lambda enc, ids: decoding.speculative(
      s.target, s.target_params, s.draft, s.draft_params, enc, gamma=cfg.gamma,
      lenience=cfg.lenience, row_ids=ids, **common)}
  if cfg.run_baseline:
    fns["autoregressive"] = lambda enc, ids: decoding.autoregressive(
        s.target, s.target_params, enc, row_ids=ids, **common)
  return fns


def _batch_rows(s: _Setup, batch: Sequence[data.Example], outputs: Mapping[str, Any],
                seconds: Mapping[str, float], batch_key: str) -> list[dict]:
  spec = outputs["speculative"]
  ar = outputs.get("autoregressive")
  tokens, lengths = np.asarray(spec.tokens), np.asarray(spec.lengths)
  st = {k: np.asarray(getattr(spec.stats, k)) for k in
        ("target_calls", "draft_tokens", "accepted", "decisions", "min_pq_sum")}
  per_position = {k: np.asarray(getattr(spec.stats, k)) for k in ("accepted_at", "decided_at")}
  rows = []
  for r, ex in enumerate(batch):
    spec_tokens = data.output_tokens(tokens[r], lengths[r])
    row = {"index": ex.index, "inputs": ex.inputs, "target": ex.targets,
           "spec_output": data.detokenize(s.vocabulary, spec_tokens), "spec_tokens": spec_tokens,
           "spec_length": int(lengths[r]), "batch": batch_key, "batch_rows": len(batch),
           "spec_batch_seconds": seconds["speculative"],
           **{k: (float(v[r]) if k == "min_pq_sum" else int(v[r])) for k, v in st.items()},
           **{k: v[r].tolist() for k, v in per_position.items()}}
    if ar is not None:
      ar_tokens = data.output_tokens(np.asarray(ar.tokens)[r], np.asarray(ar.lengths)[r])
      row.update(ar_output=data.detokenize(s.vocabulary, ar_tokens), ar_tokens=ar_tokens,
                 ar_length=len(ar_tokens),
                 ar_target_calls=int(np.asarray(ar.stats.target_calls)[r]),
                 identical=ar_tokens == spec_tokens,
                 ar_batch_seconds=seconds["autoregressive"])
    rows.append(row)
  return rows


def _decode_remaining(s: _Setup, todo: Sequence[data.Example], output_dir: str, *,
                      show_progress: bool, on_batch: Callable[[int], None] | None
                      ) -> dict[str, dict[str, float]]:
  """Decodes `todo` batch by batch, appending rows after each.

  Returns per decoder the first call's seconds (compilation + one run of the
  first batch) and the compile estimate: that minus the timed run of the batch.
  """
  cfg = s.config
  fns = _decoders(s)
  B, S = cfg.batch_size, cfg.feature_lengths["inputs"]
  batches = [todo[i:i + B] for i in range(0, len(todo), B)]

  def inputs(batch):
    enc = data.encoder_batch(batch, batch_size=B, input_length=S)
    ids = np.array([ex.index for ex in batch] + [batch[-1].index] * (B - len(batch)), np.int32)
    if s.mesh is None:
      return jnp.asarray(enc), jnp.asarray(ids)
    # Each process feeds only the rows its devices hold (all of them on one host).
    rows = distributed.process_rows(s.mesh, B)
    return (distributed.global_batch(enc[rows], s.mesh, B),
            distributed.global_batch(ids[rows], s.mesh, B))

  first_call = {name: timing.timed(lambda f=f: f(*inputs(batches[0]))).median
                for name, f in fns.items()}
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
      enc, ids = inputs(batch)
      outputs, seconds = {"encoder_tokens": enc}, {}
      for name, f in fns.items():
        t = timing.timed(lambda f=f: f(enc, ids), repeats=cfg.timing_repeats)
        outputs[name], seconds[name] = t.result, t.median
      if b == 0:
        compile_s = {name: max(first_call[name] - seconds[name], 0.0) for name in fns}
      outputs = distributed.gather(outputs)  # every process joins; process 0 writes
      if _is_writer():
        results.append_rows(path, _batch_rows(s, batch, outputs, seconds, f"{run_id}:{b}"))
      if bar is not None:
        bar.update(len(batch))
      if on_batch is not None:
        on_batch(b)
  finally:
    if bar is not None:
      bar.close()
  return {"first_call_seconds": first_call, "compile_seconds": compile_s}


def measure_step_times(s: _Setup, *, repeats: int) -> dict[str, float]:
  """Target and draft single-token step times on one batch, c, and the verify cost ratio."""
  cfg = s.config
  batch = s.examples[:cfg.batch_size]
  enc = jnp.asarray(data.encoder_batch(batch, batch_size=cfg.batch_size,
                                       input_length=cfg.feature_lengths["inputs"]))
  length = cfg.decode_len + cfg.gamma + 1  # the speculative loop's cache size
  kw = dict(cache_length=length, position=cfg.decode_len // 2, repeats=repeats, mesh=s.mesh)
  rules = cfg.rules if s.mesh is not None else None
  draft_rules = partitioning.data_parallel_rules(rules) if s.mesh is not None else None
  target_s = timing.step_time(s.target, s.target_params, enc, rules=rules, **kw)
  draft_s = timing.step_time(s.draft, s.draft_params, enc, rules=draft_rules, **kw)
  verify_s = timing.step_time(s.target, s.target_params, enc, num_tokens=cfg.gamma + 1,
                              rules=rules, **kw)
  return {"target_step_seconds": target_s, "draft_step_seconds": draft_s,
          "verify_seconds": verify_s, "c": draft_s / target_s,
          "verify_ratio": verify_s / target_s}


GAMMA_FILE = "gamma.json"
_PROBE_GAMMA = 4


def choose_gamma(s: _Setup, output_dir: str) -> dict[str, Any]:
  """The gamma maximizing Thm 3.8 for alpha and c measured on warm-up examples.

  alpha: the estimator (sum of beta over decided positions / decisions) of a
  speculative decode of the first `gamma_warmup_examples` examples with gamma 4
  (alpha does not depend on gamma); c: draft / target single-token step time on
  one batch. The choice is written to output_dir/gamma.json and reused on resume.
  """
  path = f"{output_dir}/{GAMMA_FILE}"
  if _is_writer() and os.path.exists(path):
    with open(path) as f:
      choice = json.load(f)
  else:
    cfg = s.config
    probe = dataclasses.replace(s, config=dataclasses.replace(cfg, gamma=_PROBE_GAMMA))
    warmup = s.examples[:cfg.gamma_warmup_examples]
    B, S = cfg.batch_size, cfg.feature_lengths["inputs"]
    decode = _decoders(probe)["speculative"]
    sums = np.zeros(2)
    for i in range(0, len(warmup), B):
      batch = warmup[i:i + B]
      enc = data.encoder_batch(batch, batch_size=B, input_length=S)
      ids = np.array([ex.index for ex in batch] + [batch[-1].index] * (B - len(batch)), np.int32)
      if s.mesh is not None:
        enc, ids = (partitioning.put(x, partitioning.batch_sharding(s.mesh, x.shape))
                    for x in (enc, ids))
      stats = distributed.gather(decode(enc, ids).stats)
      n = len(batch)
      sums += [np.sum(stats.min_pq_sum[:n]), np.sum(stats.decisions[:n])]
    alpha = float(sums[0] / sums[1]) if sums[1] else 0.0
    c = measure_step_times(probe, repeats=cfg.step_timing_repeats)["c"]
    gamma = int(theory.optimal_gamma(alpha, c, max_gamma=cfg.max_gamma))
    choice = {"gamma": gamma, "alpha": alpha, "c": c, "warmup_examples": len(warmup),
              "predicted_speedup": float(theory.walltime_improvement(alpha, gamma, c))}
    if _is_writer():
      results.write_json(path, choice)
  if jax.process_count() > 1:  # every process decodes with process 0's choice
    from jax.experimental import multihost_utils
    choice["gamma"] = int(multihost_utils.broadcast_one_to_all(np.int32(choice["gamma"])))
  logging.info("gamma chosen: %s", choice)
  return choice


def run_experiment(config: ExperimentConfig, *, output_dir: str, show_progress: bool = True,
                   on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
  """Runs (or resumes) `config` into output_dir and returns the results dict.

  on_batch(b) is called after batch b's rows are written (e.g. for logging).
  output_dir is locked for the run (`results.locked`): a second run into it
  fails at once. A rerun says "resuming K/N" or "already complete"; an already
  complete rerun decodes and measures nothing and reports the recorded step
  times; each run's own timings are listed in the results' 'runs'
  (`results.timing_by_run`).
  """
  if not isinstance(config, ExperimentConfig):
    raise ValueError(f"config must be an ExperimentConfig, got {type(config).__name__}")
  with results.locked(output_dir, enabled=_is_writer()):
    return _run_experiment(config, output_dir=output_dir, show_progress=show_progress,
                           on_batch=on_batch)


def _run_experiment(config: ExperimentConfig, *, output_dir: str, show_progress: bool,
                    on_batch: Callable[[int], None] | None) -> dict[str, Any]:
  start = time.perf_counter()
  say = lambda msg: cli.status(msg, enabled=show_progress and _is_writer())
  s = setup(config, status=say)  # before anything is written: a failing config leaves no trace
  path = f"{output_dir}/{results.PREDICTIONS}"
  if _is_writer():
    # A checkpoint retrained in place must not resume the old model's predictions.
    fingerprints = {role: model_specs.checkpoint_fingerprint(getattr(config, role))
                    for role in ("target", "draft")}
    results.check_config(output_dir, dict(config.to_json(), checkpoint_fingerprints=fingerprints),
                         may_differ=("num_examples", "timing_repeats", "step_timing_repeats"))
  rows = results.read_rows(path) if _is_writer() else {}
  done = np.array([ex.index in rows for ex in s.examples], bool)
  if jax.process_count() > 1:  # process 0's view of the output directory decides
    from jax.experimental import multihost_utils
    done = np.asarray(multihost_utils.broadcast_one_to_all(done))
  todo = [ex for ex, d in zip(s.examples, done) if not d]
  resume = run_status.resume_state(len(s.examples), len(todo), path)
  say(resume["message"])
  old_runs = {results.run_id_of(r) for r in rows.values()}
  gamma_choice = None
  if config.gamma is None:
    say(f"choosing gamma: measuring alpha and c on {config.gamma_warmup_examples} warm-up "
        "examples")
    gamma_choice = choose_gamma(s, output_dir)
    s = dataclasses.replace(s, config=dataclasses.replace(config, gamma=gamma_choice["gamma"]))
  compile_times = {}  # this run's; empty when nothing was left to decode
  if todo:
    say("compiling both decoders and warming up on the first batch, then decoding")
    compile_times = _decode_remaining(s, todo, output_dir, show_progress=show_progress,
                                      on_batch=on_batch)
  # Nothing decoded: report the step times measured with the rows (every process must
  # agree on measuring, so a multi-process run always measures).
  step_times = (run_status.recorded_step_times(output_dir)
                if not todo and jax.process_count() == 1 else None)
  if step_times is None:
    say("measuring single-step times of target and draft (c)")
    step_times = measure_step_times(s, repeats=config.step_timing_repeats)
  if not _is_writer():
    return {}
  rows = results.read_rows(path)
  new_runs = {results.run_id_of(r) for r in rows.values()} - old_runs
  for run_id in new_runs:
    results.record_run(output_dir, run_id, run_status.run_info(step_times))
  results.write_json(f"{output_dir}/{results.PROGRESS}",
                     {"completed": sum(ex.index in rows for ex in s.examples),
                      "total": len(s.examples)})
  summary = report.summarize(s.config, metric_fns=s.task.metric_fns, examples=s.examples,
                             rows=rows, step_times=step_times, compile_times=compile_times)
  summary["gamma_selection"] = gamma_choice
  summary["timing"]["run_seconds"] = time.perf_counter() - start
  summary.update(run_status.summary_extras(output_dir, rows, s.examples, config, resume))
  results.write_json(f"{output_dir}/{results.RESULTS}", summary)
  results.write_text(f"{output_dir}/{results.TABLE_ROW}",
                     report.TABLE_HEADER + summary["table_row"] + "\n")
  return summary
