"""What one experiment runs: `ExperimentConfig` (everything but where its files go).

  ExperimentConfig(
      target=ModelSpec(checkpoint=".../t5_1_1_xxl"), draft=ModelSpec(checkpoint=".../small"),
      task="wmt_t2t_ende_v003", decoders={"speculative": decoding.Speculative(gamma=7)},
      sampling=decoding.Sampling(temperature=0.0))

The config always names its decoders (`decoding` algorithms, each run next to the
baseline on the same batches, sampling, PRNG key and row ids); gin's default set
(`gin/runs/benchmark.gin`) writes out the baseline and one 'speculative' decoder
built from the GAMMA macro. `GammaChoice` chooses one chain decoder's gamma from
warm-up measurements instead. Every field has an effect: a config that sets one
that would not is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from spec_decode import configurable, data, decoding, partitioning
from spec_decode.experiment.model_specs import ModelSpec, check_seed

BASELINE = "autoregressive"
GAMMA_RULES = ("cost_model", "thm_3_8")


@configurable.register
@dataclasses.dataclass(frozen=True)
class GammaChoice:
  """The gamma of one chain decoder, chosen from warm-up measurements (`experiment.gamma`).

  decoder: the name of the decoder whose gamma is chosen (a `Speculative` drafting
  chains); it decodes the first warmup_examples examples at warmup_gamma (its configured
  gamma must be that: the run's gamma replaces it) to measure alpha, which does not
  depend on gamma, and c and the verify costs are measured on one batch. rule:
  'cost_model' (default) picks the gamma in 1 .. max_gamma maximizing E[tokens] /
  (gamma c + T_verify(gamma + 1) / T_p) with the verify costs measured; 'thm_3_8'
  maximizes Theorem 3.8's factor, which charges a verify call one step.

  fallback_below: gamma 0, i.e. the decoder runs the autoregressive loop, when the rule's
  predicted speedup at its best gamma is below this; None: always speculate at the best
  gamma. The default 1.1 leaves the prediction a margin: it charges the model calls only
  (not the encoders, the loop's own work, nor blocks cut short at a sequence's end), and
  measured speedups fall below it (big EnDe pair at batch 8 with refill, AMD EPYC:
  predicted 1.04X, measured 0.85X).
  measured_fallback_below: a prediction that passes `fallback_below` is then checked by
  measurement: both decoders (the speculative one at the chosen gamma) decode the warm-up
  examples in `timing_rounds` interleaved rounds after a compiling call, and the decoder
  falls back to gamma 0 when the autoregressive / speculative time (each decoder's fastest
  round) is below this (default 1.0: speculation must have paid on the warm-up). None or
  timing_rounds 0 skips the check, as does a config without a baseline; fallback_below
  None skips both checks. The timed decodes compile what the run then uses.
  in_loop_costs: c is the proposal's cost where the decoding loop runs it, each proposal
  timed after a verify call (`measure.step_costs(in_loop=True)`), instead of in a loop of
  its own; for drafts whose weights the target's evict from the CPU's caches (layer
  skipping, an exit adapter: the target's own layers). The run's step costs then report
  both (c_in_loop), and its cost model charges the in-loop one.
  """
  decoder: str = "speculative"
  rule: str = "cost_model"
  max_gamma: int = 10
  warmup_examples: int = 16
  warmup_gamma: int = 4
  fallback_below: float | None = 1.1
  measured_fallback_below: float | None = 1.0
  timing_rounds: int = 2
  in_loop_costs: bool = False

  def __post_init__(self):
    if not isinstance(self.decoder, str) or not self.decoder:
      raise ValueError(f"GammaChoice.decoder must name a decoder, got {self.decoder!r}")
    if self.rule not in GAMMA_RULES:
      raise ValueError(f"GammaChoice.rule must be one of {GAMMA_RULES}, got {self.rule!r}")
    for name in ("max_gamma", "warmup_examples", "warmup_gamma"):
      if not configurable.is_int(getattr(self, name)) or getattr(self, name) < 1:
        raise ValueError(f"GammaChoice.{name} must be an int >= 1, got {getattr(self, name)!r}")
    for name in ("fallback_below", "measured_fallback_below"):
      f = getattr(self, name)
      if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float, np.floating))
                            or not math.isfinite(f) or f <= 0):
        raise ValueError(f"GammaChoice.{name} must be a finite speedup > 0 or None, "
                         f"got {f!r}")
    if not isinstance(self.in_loop_costs, bool):
      raise ValueError(f"GammaChoice.in_loop_costs must be True or False, got "
                       f"{self.in_loop_costs!r}")
    if not configurable.is_int(self.timing_rounds) or self.timing_rounds < 0:
      raise ValueError(f"GammaChoice.timing_rounds must be an int >= 0, got "
                       f"{self.timing_rounds!r}")

  def times_warmup(self, has_baseline: bool) -> bool:
    """Whether a prediction that passes `fallback_below` is checked by timing the decoders
    on the warm-up examples (it needs a baseline to time against)."""
    return (self.fallback_below is not None and self.measured_fallback_below is not None
            and self.timing_rounds > 0 and has_baseline)

  def check(self, decoders: Mapping[str, decoding.Algorithm]) -> None:
    """Raises ValueError unless `decoders` holds a chain decoder of this name drafting at
    warmup_gamma (any other configured gamma would have no effect)."""
    algo = decoders.get(self.decoder)
    if not isinstance(algo, decoding.Speculative) or algo.drafter.proposes_trees:
      raise ValueError(f"GammaChoice.decoder {self.decoder!r} must name a Speculative decoder "
                       f"that drafts chains; the decoders are {sorted(decoders)}")
    if algo.gamma != self.warmup_gamma:
      raise ValueError(f"GammaChoice chooses the gamma of decoder {self.decoder!r} (its warm-up "
                       f"decodes at GammaChoice.warmup_gamma {self.warmup_gamma}), so its "
                       f"configured gamma {algo.gamma} would have no effect; to decode at gamma "
                       f"{algo.gamma}, set ExperimentConfig.gamma_choice = None")


@configurable.register
@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Settings of one experiment.

  target, draft: the models (draft None when no decoder needs one). task, split,
  num_examples (None = the whole split): the data; feature_lengths: seqio input/target
  lengths (inputs are cut to fit); max_decode_len: default feature_lengths['targets'].
  decoders: {name: decoding Algorithm}, compared with the baseline (the first is the
  primary one, the paper's table row). baseline: the autoregressive decoder every speedup
  is measured against, named "autoregressive" (None: no baseline). sampling: the same for
  every decoder (temperature 0 = greedy). gamma_choice: choose one decoder's gamma from
  warm-up measurements (`GammaChoice`), or None. seed: the PRNG key.
  timing_repeats: timed runs per batch (median; the decoders take turns, one run each per
  round, `timing.timed_in_turns`). step_timing_repeats: interleaved rounds of
  the step-cost measurements (`experiment.measure`). logical_axis_rules: (logical, mesh
  axis) pairs placed before T5X's standard rules (so they override them), and
  parameter_partitioning_dims (1 or 2, as T5X): the target's layout on the mesh (the draft
  is replicated, its batch sharded). mesh: e.g. 'data=1,model=4' to shard over the local
  devices. vocabulary: SentencePiece model for T5's tasks instead of gs://t5-data's;
  tfds_data_dir: where TFDS data is prepared. compiler_options: XLA options of every
  compiled decoding loop and step timer (unsharded runs); None: the backend's defaults
  (`spec_decode.compile_options`), {}: XLA's own. refill_chunk: 0 decodes batch by batch,
  each batch until its slowest row is done; k >= 1 gives each decode call k x batch_size
  examples in batch_size slots, a finished row's slot taking the next example inside the
  loop (`decoding.run(refill_batch=)`, unsharded runs); rows are written after each call.
  """
  target: ModelSpec
  draft: ModelSpec | None
  task: str
  decoders: Mapping[str, decoding.Algorithm]
  split: str = "validation"
  num_examples: int | None = 100
  batch_size: int = 1
  feature_lengths: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"inputs": 64, "targets": 64})
  max_decode_len: int | None = None
  sampling: decoding.Sampling = decoding.Sampling()
  baseline: decoding.Autoregressive | None = decoding.Autoregressive()
  gamma_choice: GammaChoice | None = None
  seed: int = 0
  timing_repeats: int = 1
  step_timing_repeats: int = 10
  mesh: str | None = None
  logical_axis_rules: Sequence[tuple[str, Any]] = ()
  parameter_partitioning_dims: int = 1
  vocabulary: str | None = None
  tfds_data_dir: str | None = None
  compiler_options: Mapping[str, Any] | None = None
  refill_chunk: int = 0

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
    if self.baseline is not None and not isinstance(self.baseline, decoding.Autoregressive):
      raise ValueError(f"ExperimentConfig.baseline must be a decoding.Autoregressive or None, "
                       f"got {type(self.baseline).__name__}")
    if not self.decoders and self.baseline is None:
      raise ValueError("ExperimentConfig has nothing to decode: no decoders and no baseline")
    if not isinstance(self.sampling, decoding.Sampling):
      raise ValueError(f"ExperimentConfig.sampling must be a decoding.Sampling, got "
                       f"{type(self.sampling).__name__}")
    if self.gamma_choice is not None:
      if not isinstance(self.gamma_choice, GammaChoice):
        raise ValueError(f"ExperimentConfig.gamma_choice must be a GammaChoice or None, got "
                         f"{type(self.gamma_choice).__name__}")
      self.gamma_choice.check(self.decoders)
    if self.compiler_options is not None:
      if not isinstance(self.compiler_options, Mapping):
        raise ValueError(f"ExperimentConfig.compiler_options must map XLA option names to "
                         f"values, got {type(self.compiler_options).__name__}")
      if self.mesh:
        raise ValueError("ExperimentConfig.compiler_options apply to unsharded runs (mesh None)")
      object.__setattr__(self, "compiler_options", dict(self.compiler_options))
    if self.mesh:
      compacting = [n for n, a in self.algorithms.items() if a.compact_batch]
      if compacting:
        raise ValueError(f"decoders {compacting} shrink their batch (compact_batch), which "
                         "applies to unsharded runs (mesh None)")
    if not configurable.is_int(self.refill_chunk) or self.refill_chunk < 0:
      raise ValueError(f"ExperimentConfig.refill_chunk must be an int >= 0, got "
                       f"{self.refill_chunk!r}")
    if self.refill_chunk:
      if self.mesh:
        raise ValueError("ExperimentConfig.refill_chunk applies to unsharded runs (mesh None)")
      for name, algo in self.algorithms.items():
        try:
          algo.check_refill()
        except ValueError as e:
          raise ValueError(f"decoders[{name!r}] cannot refill its batch (refill_chunk): "
                           f"{e}") from None
    if self.mesh:
      partitioning.check_mesh_axes(self.mesh, self.rules)
    check_seed("ExperimentConfig.seed", self.seed)
    if not isinstance(self.task, str) or not self.task:
      raise ValueError(f"ExperimentConfig.task must be a task name, got {self.task!r}")
    for name in ("batch_size", "timing_repeats", "step_timing_repeats"):
      if not configurable.is_int(getattr(self, name)) or getattr(self, name) < 1:
        raise ValueError(f"ExperimentConfig.{name} must be an int >= 1, "
                         f"got {getattr(self, name)!r}")
    if self.num_examples is not None and (not configurable.is_int(self.num_examples)
                                          or self.num_examples < 1):
      raise ValueError(f"num_examples must be an int >= 1 or None, got {self.num_examples!r}")
    object.__setattr__(self, "feature_lengths", data.check_feature_lengths(self.feature_lengths))
    if self.max_decode_len is not None and (not configurable.is_int(self.max_decode_len)
                                            or self.max_decode_len < 1):
      raise ValueError(f"max_decode_len must be an int >= 1 or None, got {self.max_decode_len!r}")
    for name, algo in self.decoders.items():
      if configurable.is_int(algo.gamma) and algo.gamma > self.decode_len:
        raise ValueError(f"decoders[{name!r}] has gamma {algo.gamma}, larger than the "
                         f"{self.decode_len} tokens decoded per example (max_decode_len): use "
                         f"gamma <= {self.decode_len}")
    needs_draft = [n for n, a in self.algorithms.items() if a.needs_draft]
    if self.draft is None and needs_draft:
      raise ValueError(f"decoders {needs_draft} need a draft model but ExperimentConfig.draft "
                       "is None")
    if self.draft is not None and not needs_draft:
      raise ValueError("ExperimentConfig.draft is set but no decoder drafts with a model; set "
                       "ExperimentConfig.draft = None")

  @property
  def decode_len(self) -> int:
    return self.max_decode_len or self.feature_lengths["targets"]

  @property
  def algorithms(self) -> dict[str, decoding.Algorithm]:
    """{name: algorithm}: the baseline ("autoregressive") first when there is one, then the
    decoders."""
    out = {BASELINE: self.baseline} if self.baseline is not None else {}
    out.update(self.decoders)
    return out

  @property
  def baseline_name(self) -> str | None:
    return BASELINE if self.baseline is not None else None

  @property
  def primary(self) -> str | None:
    """The first decoder other than the baseline (the one the table row describes)."""
    return next(iter(self.decoders), None)

  def with_gamma(self, name: str, gamma: int) -> "ExperimentConfig":
    """This config with decoder `name` at `gamma` and no gamma choice (the chosen gamma)."""
    decoders = dict(self.decoders, **{name: dataclasses.replace(self.decoders[name],
                                                                  gamma=gamma)})
    return dataclasses.replace(self, decoders=decoders, gamma_choice=None)

  def without_speculation(self, name: str) -> "ExperimentConfig":
    """This config with decoder `name` replaced by the autoregressive loop (with its
    compact_batch setting) and no gamma choice: a gamma choice's fallback (gamma 0). The
    draft is dropped when no decoder drafts with it any more."""
    algo = decoding.Autoregressive(compact_batch=self.decoders[name].compact_batch)
    decoders = dict(self.decoders, **{name: algo})
    drafting = any(a.needs_draft for a in decoders.values())
    return dataclasses.replace(self, decoders=decoders, gamma_choice=None,
                               draft=self.draft if drafting else None)

  def to_json(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["target"] = self.target.to_json()
    d["draft"] = None if self.draft is None else self.draft.to_json()
    d["decoders"] = {name: decoding.registry.describe(a) for name, a in self.decoders.items()}
    d["sampling"] = dataclasses.asdict(self.sampling)
    d["baseline"] = None if self.baseline is None else decoding.registry.describe(self.baseline)
    d["gamma_choice"] = None if self.gamma_choice is None else dataclasses.asdict(
        self.gamma_choice)
    d["feature_lengths"] = dict(self.feature_lengths)
    d["logical_axis_rules"] = [list(r) for r in self.logical_axis_rules]
    if d["compiler_options"] is None:
      del d["compiler_options"]  # recorded only when set
    return d

  @property
  def rules(self):
    """The target's logical axis rules (T5X's standard ones, overridden as configured)."""
    return partitioning.standard_logical_axis_rules(
        parameter_partitioning_dims=self.parameter_partitioning_dims,
        additional_rules=tuple(tuple(r) for r in self.logical_axis_rules))
