"""One experiment: a target (and a draft) on N examples of a task, a baseline and named decoders.

  results = run_experiment(ExperimentConfig(
      target=ModelSpec(checkpoint=".../t5_1_1_xxl"), draft=ModelSpec(checkpoint=".../small"),
      task="wmt_t2t_ende_v003", gamma=7), output_dir="/tmp/ende_small")

The decoders are `decoding` algorithms: by default the autoregressive
baseline and `Speculative(gamma, lenience)` named "speculative"; any number of
others can be named in `ExperimentConfig.decoders`, e.g. from gin
  ExperimentConfig.decoders = {'g3': @g3/Speculative(), 'g5': @g5/Speculative()}
Every decoder runs on the same batches with the same sampling settings, PRNG
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
import math
import os
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import (batching, cli, data, decoding, distributed, metrics, model_specs,
                         partitioning, report, results, run_status, theory)
from spec_decode.decoding import runner, timing
from spec_decode.model_specs import LoadContext, ModelSpec



@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Settings of one experiment (everything but where its files go).

  target, draft: the models. task, split, num_examples (None = the whole
  split): the data; feature_lengths: seqio input/target lengths (inputs are
  cut to fit); max_decode_len: default feature_lengths['targets'].
  decoders: {name: decoding Algorithm}, the decoders compared with the baseline;
  empty (the default) means {"speculative": Speculative(gamma, lenience)}, and
  only then are gamma and lenience read: gamma None picks it with
  theory.optimal_gamma (up to max_gamma) from alpha and c measured on the first
  gamma_warmup_examples examples (see `choose_gamma`), by gamma_rule: 'cost_model'
  (default) also measures what verifying 2 .. max_gamma + 1 tokens costs and
  maximizes E[tokens] / (gamma c + T_verify(gamma + 1) / T_p); 'thm_3_8' maximizes
  Theorem 3.8's factor, which charges a verify call one step. temperature, top_k, top_p:
  sampling, the same for every decoder (temperature 0 = greedy). seed: the PRNG key.
  run_baseline: also decode autoregressively (the baseline of every speedup),
  as the decoder named "autoregressive". draft: the draft model of the decoders
  that need one (None when none does).
  timing_repeats: timed runs per batch (median). step_timing_repeats: runs of
  each single-step measurement for c. logical_axis_rules: (logical, mesh axis)
  pairs placed before T5X's standard rules (so they override them), and
  parameter_partitioning_dims (1 or 2, as T5X): the target's layout on the mesh
  (the draft is replicated, its batch sharded). mesh: e.g. 'data=1,model=4' to shard
  over the local devices. vocabulary: SentencePiece model for T5's tasks
  instead of gs://t5-data's; tfds_data_dir: where TFDS data is prepared.
  compiler_options: XLA options of every compiled decoding loop and step timer
  (unsharded runs); None: the backend's defaults (`spec_decode.compile_options`),
  {}: XLA's own. compact_batch: the baseline and the default decoder shrink their batch
  as rows finish (`runner.compacting_loop`; unsharded runs, outputs unchanged); named
  decoders set their own.
  """
  target: ModelSpec
  draft: ModelSpec | None
  task: str
  split: str = "validation"
  num_examples: int | None = 100
  batch_size: int = 1
  feature_lengths: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"inputs": 64, "targets": 64})
  max_decode_len: int | None = None
  gamma: int | None = 7
  gamma_warmup_examples: int = 16
  max_gamma: int = 10
  gamma_rule: str = "cost_model"
  compact_batch: bool = False
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
  decoders: Mapping[str, decoding.Algorithm] = dataclasses.field(default_factory=dict)
  compiler_options: Mapping[str, Any] | None = None

  def __post_init__(self):
    if not isinstance(self.target, ModelSpec):
      raise ValueError(f"ExperimentConfig.target must be a ModelSpec, got "
                       f"{type(self.target).__name__}")
    if self.draft is not None and not isinstance(self.draft, ModelSpec):
      raise ValueError(f"ExperimentConfig.draft must be a ModelSpec or None, got "
                       f"{type(self.draft).__name__}")
    if not isinstance(self.decoders, Mapping):
      raise ValueError(f"ExperimentConfig.decoders must map names to decoding algorithms, got "
                       f"{type(self.decoders).__name__}")
    for name, algo in self.decoders.items():
      if not isinstance(name, str) or not name or name == BASELINE:
        raise ValueError(f"decoder names must be non-empty strings other than {BASELINE!r}, "
                         f"got {name!r}")
      if not isinstance(algo, decoding.Algorithm):
        raise ValueError(f"ExperimentConfig.decoders[{name!r}] must be a decoding algorithm "
                         f"(e.g. Speculative(gamma=4)), got {type(algo).__name__}")
    object.__setattr__(self, "decoders", dict(self.decoders))
    if self.compiler_options is not None:
      if not isinstance(self.compiler_options, Mapping):
        raise ValueError(f"ExperimentConfig.compiler_options must map XLA option names to "
                         f"values, got {type(self.compiler_options).__name__}")
      if self.mesh:
        raise ValueError("ExperimentConfig.compiler_options apply to unsharded runs (mesh None)")
      object.__setattr__(self, "compiler_options", dict(self.compiler_options))
    if not isinstance(self.compact_batch, bool):
      raise ValueError(f"ExperimentConfig.compact_batch must be True or False, got "
                       f"{self.compact_batch!r}")
    if self.compact_batch and self.mesh:
      raise ValueError("ExperimentConfig.compact_batch applies to unsharded runs (mesh None)")
    if self.decoders and self.gamma is None:
      raise ValueError("gamma None (automatic choice) applies only to the default decoder; "
                       "with ExperimentConfig.decoders set, give each Speculative its gamma")

    if self.gamma_rule not in GAMMA_RULES:
      raise ValueError(f"ExperimentConfig.gamma_rule must be one of {GAMMA_RULES}, got "
                       f"{self.gamma_rule!r}")
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
    if self.draft is None and any(a.needs_draft for a in self.algorithms.values()):
      raise ValueError("a decoder needs a draft model but ExperimentConfig.draft is None")
    decoding.Sampling(temperature=float(self.temperature), top_k=self.top_k,
                      top_p=float(self.top_p))  # validates them

  @property
  def sampling(self) -> decoding.Sampling:
    return decoding.Sampling(temperature=float(self.temperature), top_k=self.top_k,
                             top_p=float(self.top_p))

  @property
  def decode_len(self) -> int:
    return self.max_decode_len or self.feature_lengths["targets"]

  @property
  def algorithms(self) -> dict[str, decoding.Algorithm]:
    """{name: algorithm}, the baseline ("autoregressive") first when it runs.

    With gamma None the default decoder's gamma is a placeholder until
    `choose_gamma` replaces the config with the chosen one.
    """
    out = ({BASELINE: decoding.Autoregressive(compact_batch=self.compact_batch)}
           if self.run_baseline else {})
    if self.decoders:
      out.update(self.decoders)
    else:
      out[DEFAULT_DECODER] = decoding.Speculative(gamma=self.gamma or _PROBE_GAMMA,
                                                  lenience=float(self.lenience),
                                                  compact_batch=self.compact_batch)
    return out

  @property
  def baseline(self) -> str | None:
    return BASELINE if self.run_baseline else None

  @property
  def primary(self) -> str | None:
    """The first decoder other than the baseline (the one the table row describes)."""
    return next((n for n in self.algorithms if n != BASELINE), None)

  def to_json(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["target"] = self.target.to_json()
    d["draft"] = None if self.draft is None else self.draft.to_json()
    d["decoders"] = {name: decoding.registry.describe(a) for name, a in self.decoders.items()}
    d["feature_lengths"] = dict(self.feature_lengths)
    d["logical_axis_rules"] = [list(r) for r in self.logical_axis_rules]
    if d["compiler_options"] is None:
      del d["compiler_options"]  # recorded only when set, so older runs' config.json match
    if self.gamma is not None:
      del d["gamma_rule"]  # read only when gamma is chosen automatically
    if not self.compact_batch:
      del d["compact_batch"]  # recorded only when set, so older runs' config.json match
    return d

  @property
  def rules(self):
    """The target's logical axis rules (T5X's standard ones, overridden as configured)."""
    return partitioning.standard_logical_axis_rules(
        parameter_partitioning_dims=self.parameter_partitioning_dims,
        additional_rules=tuple(tuple(r) for r in self.logical_axis_rules))


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


BASELINE = "autoregressive"
DEFAULT_DECODER = "speculative"
_PROBE_GAMMA = 4
GAMMA_RULES = ("cost_model", "thm_3_8")


def verify_probe_tokens(max_gamma: int) -> tuple[int, ...]:
  """The verify sizes N = gamma + 1 whose cost `choose_gamma` measures for its cost model:
  2 .. 6 and then every other size up to max_gamma + 1 (the cost model interpolates
  between them; each size is one more compiled step timer)."""
  top = max_gamma + 1
  return tuple(sorted({n for n in range(2, min(top, 6) + 1)} | set(range(6, top + 1, 2))
                      | {top}))


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
  roles = ("target",) if config.draft is None else ("target", "draft")
  for role in roles:
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

  draft = dparams = None
  if config.draft is not None:
    status(f"loading the draft model ({config.draft.label})")
    draft, dparams = model_specs.load(config.draft, LoadContext(
        "draft", vocab_size=target.vocab_size, mesh=mesh, target_sequences=target_sequences))
  if mesh is not None:  # the decoders' layouts: target by T5X's rules, draft replicated
    tparams = partitioning.put(tparams, partitioning.param_shardings(
        target, mesh, config.rules, params=tparams))
    if draft is not None:
      dparams = partitioning.put(dparams, partitioning.param_shardings(
          draft, mesh, partitioning.data_parallel_rules(config.rules), params=dparams))
  return _Setup(config, task, tuple(examples), target, tparams, draft, dparams, mesh)


def _decoders(s: _Setup) -> dict[str, Callable[[jax.Array, jax.Array], decoding.DecodeResult]]:
  """{name: (encoder tokens, row ids) -> DecodeResult}, one per configured algorithm."""
  cfg = s.config
  common = dict(max_decode_len=cfg.decode_len, sampling=cfg.sampling,
                rng=jax.random.PRNGKey(cfg.seed))
  if s.mesh is not None:
    common.update(mesh=s.mesh, rules=cfg.rules)
  else:
    common.update(compiler_options=cfg.compiler_options)

  def make(algorithm):
    drafts = dict(draft=s.draft, draft_params=s.draft_params) if algorithm.needs_draft else {}
    return lambda enc, ids: decoding.run(algorithm, s.target, s.target_params, enc,
                                         row_ids=ids, **drafts, **common)
  return {name: make(a) for name, a in cfg.algorithms.items()}


def _row_stats(stats: decoding.DecodeStats, r: int) -> dict[str, Any]:
  """Row r's counters as JSON values (ints, floats, or lists for per-position ones)."""
  out = {}
  for name, v in stats.counters.items():
    x = np.asarray(v)[r]
    out[name] = x.tolist() if x.ndim else (float(x) if x.dtype.kind == "f" else int(x))
  return out


def _batch_rows(s: _Setup, batch: Sequence[data.Example], outputs: Mapping[str, Any],
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
                       "stats": _row_stats(res.stats, r)}
    rows.append({"index": ex.index, "inputs": ex.inputs, "target": ex.targets,
                 "batch": batch_key, "batch_rows": len(batch), "decoders": decoded})
  return rows


def _inputs(s: _Setup, batch: Sequence[data.Example]) -> tuple[jax.Array, jax.Array]:
  """A batch's encoder tokens [B, S] and row ids [B] (the example indices), padded to
  the batch size by repeating the last example, laid out on the mesh when there is one."""
  cfg = s.config
  B = cfg.batch_size
  enc, ids = batching.example_batch(batch, batch_size=B,
                                    input_length=cfg.feature_lengths["inputs"])
  if s.mesh is None:
    return jnp.asarray(enc), jnp.asarray(ids)
  # Each process feeds only the rows its devices hold (all of them on one host).
  rows = distributed.process_rows(s.mesh, B)
  return (distributed.global_batch(enc[rows], s.mesh, B),
          distributed.global_batch(ids[rows], s.mesh, B))


def _decode_remaining(s: _Setup, todo: Sequence[data.Example], output_dir: str, *,
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
  fns = _decoders(s)
  B = cfg.batch_size
  batches = [todo[i:i + B] for i in range(0, len(todo), B)]
  first_call = {name: timing.timed(lambda f=f: f(*_inputs(s, batches[0]))).median
                for name, f in fns.items()}
  if s.mesh is None:
    _compile_input_lengths(s, fns, batches)
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
      enc, ids = _inputs(s, batch)
      outputs, seconds = {}, {}
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


def _compile_input_lengths(s: _Setup, fns, batches) -> None:
  """One untimed call of every decoder on the first batch of each input shape (trimmed and
  packed length, `runner.compiled_shape`) after the first batch's, so that no timed batch
  includes a compile."""
  seen = {runner.compiled_shape(s.target, _inputs(s, batches[0])[0])}
  for batch in batches[1:]:
    enc, ids = _inputs(s, batch)
    n = runner.compiled_shape(s.target, enc)
    if n not in seen:
      seen.add(n)
      for f in fns.values():
        jax.block_until_ready(f(enc, ids))


def step_costs(workload: timing.Workload, decoders: Mapping[str, decoding.Algorithm], *,
               drafts: Mapping[str, tuple[Any, Any]] | None = None, verify_tokens=(),
               repeats: int, inner: int = 1, steps: int = 8) -> dict[str, Any]:
  """Step costs of decoders on one batch, as their loops run them: every cost the marginal
  cost of one more call inside a jitted loop, all timed in the same interleaved rounds
  (`timing.interleaved`), so ratios are taken within a round.

  target_step: T_p, the target's single-token step; proposal[name]: one proposal of each
  decoder that drafts (its drafter's own `proposal_loop` at its gamma); verify[n]: a target
  call on n tokens, for every n = K + 1 some decoder verifies at once (K its largest
  proposal) and every n in verify_tokens. Each is a `timing.spread` over the rounds, its
  median the cost. From those medians: c[name] = proposal / (gamma T_p), the decoder's
  cost per drafted token (for the model drafter the paper's c = T_q / T_p), and
  verify_ratio[n] = T_verify(n) / T_p; c_rounds and verify_ratio_rounds: the spreads of
  the same ratios taken within each round (their noise). target_loop: the target's step
  loop (what it reads: `costs.decode_bytes`). drafts: {name: (draft model, params)} of
  decoders whose draft is not the workload's.
  """
  sizes = sorted({a.max_proposal + 1 for a in decoders.values() if a.max_proposal is not None}
                 | set(verify_tokens))
  target = lambda n: timing.marginal_pair(
      lambda k: workload.decode_loop("target", num_tokens=n, steps=k), steps)
  loops = {"target": target(1)}
  drafting = {name: a for name, a in decoders.items() if a.drafter is not None}
  for name, a in drafting.items():
    w = workload
    if drafts and name in drafts:
      w = dataclasses.replace(workload, draft=drafts[name][0], draft_params=drafts[name][1])
    loops[f"proposal:{name}"] = timing.marginal_pair(
        lambda k, a=a, w=w: a.drafter.proposal_loop(w, gamma=a.gamma, steps=k), steps)
  for n in sizes:
    loops[f"verify:{n}"] = target(n)
  t = timing.interleaved(loops, repeats=repeats, inner=inner)
  t_p = t["target"]
  spreads = {name: timing.spread(v) for name, v in t.items()}
  median = lambda name: spreads[name]["median"]
  per_round = lambda num, scale=1.0: timing.spread([a / (scale * b) for a, b in zip(num, t_p)])
  return {
      "target_step": spreads["target"],
      "proposal": {n: spreads[f"proposal:{n}"] for n in drafting},
      "verify": {n: spreads[f"verify:{n}"] for n in sizes},
      "c": {n: median(f"proposal:{n}") / (a.gamma * median("target"))
            for n, a in drafting.items()},
      "c_rounds": {n: per_round(t[f"proposal:{n}"], a.gamma) for n, a in drafting.items()},
      "verify_ratio": {n: median(f"verify:{n}") / median("target") for n in sizes},
      "verify_ratio_rounds": {n: per_round(t[f"verify:{n}"]) for n in sizes},
      "target_loop": loops["target"][0]}


def measure_step_times(s: _Setup, *, repeats: int, verify_tokens=()) -> dict[str, Any]:
  """The run's step costs on its first batch (`step_costs`, medians), as results.json keeps
  them: target_step_seconds T_p; per decoder that drafts proposal_seconds[name] and
  c_by_decoder[name]; for the primary decoder draft_step_seconds (its cost per drafted
  token) and c, verify_seconds and verify_ratio (T_verify(K + 1) / T_p);
  verify_ratio_by_tokens[n] for every n measured (see `step_costs`)."""
  cfg = s.config
  batch = s.examples[:cfg.batch_size]
  enc, _ = _inputs(s, batch)
  algorithms = cfg.algorithms
  sizes = [a.max_proposal + 1 for a in algorithms.values() if a.max_proposal is not None]
  length = cfg.decode_len + max(sizes + list(verify_tokens), default=1)  # the loop's cache
  rules = cfg.rules if s.mesh is not None else None
  workload = timing.Workload(
      target=s.target, target_params=s.target_params, encoder_tokens=enc, cache_length=length,
      position=cfg.decode_len // 2, draft=s.draft, draft_params=s.draft_params,
      sampling=cfg.sampling, mesh=s.mesh, rules=rules,
      draft_rules=partitioning.data_parallel_rules(rules) if s.mesh is not None else None,
      compiler_options=cfg.compiler_options)
  costs = step_costs(workload, algorithms, verify_tokens=verify_tokens, repeats=repeats)
  out: dict[str, Any] = {"target_step_seconds": costs["target_step"]["median"]}
  if costs["proposal"]:
    out["proposal_seconds"] = {k: v["median"] for k, v in costs["proposal"].items()}
    out["c_by_decoder"] = dict(costs["c"])
  primary = cfg.primary
  if primary in costs["proposal"]:
    gamma = algorithms[primary].gamma
    out.update(draft_step_seconds=costs["proposal"][primary]["median"] / gamma,
               c=costs["c"][primary])
  out["verify_ratio_by_tokens"] = {str(n): v for n, v in costs["verify_ratio"].items()}
  K = algorithms[primary].max_proposal if primary is not None else None
  if K is not None:
    out["verify_seconds"] = costs["verify"][K + 1]["median"]
    out["verify_ratio"] = costs["verify_ratio"][K + 1]
  return out


GAMMA_FILE = "gamma.json"


def _broadcast(x):
  """Process 0's value of a numpy array or scalar on every process (identity on one)."""
  if jax.process_count() == 1:
    return x
  from jax.experimental import multihost_utils
  return multihost_utils.broadcast_one_to_all(x)


def choose_gamma(s: _Setup, output_dir: str) -> dict[str, Any]:
  """The gamma maximizing the expected speedup for alpha and costs measured on warm-up
  examples, by `ExperimentConfig.gamma_rule`.

  alpha: the estimator (sum of beta over decided positions / decisions) of a
  speculative decode of the first `gamma_warmup_examples` examples with gamma 4
  (alpha does not depend on gamma); c: draft / target single-token step time on
  one batch; with the 'cost_model' rule also t(N) = T_verify(N) / T_p on that batch for
  N in `verify_probe_tokens(max_gamma)`, made non-decreasing in N
  (`theory.nondecreasing_costs`) and interpolated between them
  (`theory.optimal_gamma(..., verify_ratio=t)`): on a target whose verify call costs
  more than a step (a CPU, a large batch) Thm 3.8 picks too large a gamma. Both rules'
  choices and predictions are recorded. The choice is written to output_dir/gamma.json
  and reused on resume. Process 0 decides whether a recorded choice exists, so every process
  either reads it or joins the same warm-up decodes.
  """
  path = f"{output_dir}/{GAMMA_FILE}"
  recorded = _is_writer() and os.path.exists(path)
  if bool(_broadcast(np.bool_(recorded))):
    choice = None
    if _is_writer():
      with open(path) as f:
        choice = json.load(f)
  else:
    cfg = s.config
    probe = dataclasses.replace(s, config=dataclasses.replace(cfg, gamma=_PROBE_GAMMA))
    warmup = s.examples[:cfg.gamma_warmup_examples]
    decode = _decoders(probe)[DEFAULT_DECODER]
    sums = np.zeros(2)
    for i in range(0, len(warmup), cfg.batch_size):
      batch = warmup[i:i + cfg.batch_size]
      stats = distributed.gather(decode(*_inputs(s, batch)).stats)
      n = len(batch)
      sums += [np.sum(stats.min_pq_sum[:n]), np.sum(stats.decisions[:n])]
    alpha = metrics.alpha_estimate(min_pq_sum=sums[0], decisions=sums[1])
    if math.isnan(alpha):
      raise ValueError(f"the {len(warmup)} warm-up examples made no draft decisions (every "
                       "output ended at once), so alpha is unknown: set gamma explicitly or "
                       "raise gamma_warmup_examples")
    measured = cfg.gamma_rule == "cost_model"
    steps = measure_step_times(probe, repeats=cfg.step_timing_repeats, verify_tokens=(
        verify_probe_tokens(cfg.max_gamma) if measured else ()))
    c = steps["c"]
    thm_gamma = int(theory.optimal_gamma(alpha, c, max_gamma=cfg.max_gamma))
    choice = {"rule": cfg.gamma_rule, "alpha": alpha, "c": c, "warmup_examples": len(warmup),
              "thm_3_8": {"gamma": thm_gamma, "predicted_speedup": float(
                  theory.walltime_improvement(alpha, thm_gamma, c))}}
    if measured:
      raw = {int(n): r for n, r in steps["verify_ratio_by_tokens"].items()}
      ratios = theory.nondecreasing_costs(raw)  # timing noise must not pick gamma
      cm_gamma = int(theory.optimal_gamma(alpha, c, max_gamma=cfg.max_gamma,
                                          verify_ratio=ratios))
      choice["verify_ratio_by_tokens"] = {str(n): r for n, r in sorted(raw.items())}
      choice["verify_ratio_fitted"] = {str(n): r for n, r in sorted(ratios.items())}
      choice["cost_model"] = {"gamma": cm_gamma, "predicted_speedup": float(
          theory.cost_model_improvement(alpha, cm_gamma, c, ratios))}
    choice["gamma"] = choice[cfg.gamma_rule]["gamma"]
    choice["predicted_speedup"] = choice[cfg.gamma_rule]["predicted_speedup"]
    if _is_writer():
      results.write_json(path, choice)
  gamma = int(_broadcast(np.int32(choice["gamma"] if _is_writer() else 0)))
  choice = dict(choice or {}, gamma=gamma)  # every process decodes with process 0's choice
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

  When it ends, compiled executables are dropped if the process holds many
  (`release_executables_if_crowded`), so a sweep of many experiments in one
  process cannot crash in a later compilation.
  """
  if not isinstance(config, ExperimentConfig):
    raise ValueError(f"config must be an ExperimentConfig, got {type(config).__name__}")
  try:
    with results.locked(output_dir, enabled=_is_writer()):
      return _run_experiment(config, output_dir=output_dir, show_progress=show_progress,
                             on_batch=on_batch)
  finally:
    release_executables_if_crowded()


def memory_map_use() -> tuple[int, int] | None:
  """(memory regions this process maps, the kernel's limit), or None off Linux."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read().strip())
  except (OSError, ValueError):
    return None
  return used, limit


def release_executables_if_crowded(fraction: float = 0.5) -> bool:
  """Drops every compiled executable (`jax.clear_caches`) once the process maps more
  than `fraction` of the kernel's vm.max_map_count memory regions; True if it did.

  XLA:CPU maps each executable's code and data into regions of its own (measured
  here: ~6 for a small function, ~770 for a speculative decoding loop of the demo
  pair, a few hundred for an autoregressive one) and keeps them while the executable
  is cached. A process that holds about 80 decoding loops (a gamma x draft sweep)
  reaches the limit (65530 by default), and the next compilation fails inside XLA
  ("LLVM ERROR: Unable to allocate section memory", or a segmentation fault).
  Dropping the caches only costs recompiling what is used again.
  """
  use = memory_map_use()
  if use is None or use[0] <= fraction * use[1]:
    return False
  logging.info("releasing compiled executables: %d of %d memory maps in use", *use)
  jax.clear_caches()
  return True


def _run_experiment(config: ExperimentConfig, *, output_dir: str, show_progress: bool,
                    on_batch: Callable[[int], None] | None) -> dict[str, Any]:
  start = time.perf_counter()
  say = lambda msg: cli.status(msg, enabled=show_progress and _is_writer())
  s = setup(config, status=say)  # before anything is written: a failing config leaves no trace
  path = f"{output_dir}/{results.PREDICTIONS}"
  if _is_writer():
    # A checkpoint retrained in place must not resume the old model's predictions.
    fingerprints = {role: model_specs.checkpoint_fingerprint(getattr(config, role))
                    for role in ("target", "draft") if getattr(config, role) is not None}
    results.check_config(output_dir, dict(config.to_json(), checkpoint_fingerprints=fingerprints),
                         may_differ=("num_examples", "timing_repeats", "step_timing_repeats"))
  rows = results.read_rows(path) if _is_writer() else {}
  # process 0's view of the output directory decides
  done = np.asarray(_broadcast(np.array([ex.index in rows for ex in s.examples], bool)))
  todo = [ex for ex, d in zip(s.examples, done) if not d]
  resume = run_status.resume_state(len(s.examples), len(todo), path)
  say(resume["message"])
  old_runs = {results.run_id_of(r) for r in rows.values()}
  gamma_choice = None
  if config.gamma is None and not config.decoders:
    say(f"choosing gamma ({config.gamma_rule}): measuring alpha, c"
        + (" and the verify costs" if config.gamma_rule == "cost_model" else "")
        + f" on {config.gamma_warmup_examples} warm-up examples")
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
