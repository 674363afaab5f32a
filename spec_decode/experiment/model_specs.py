"""What an experiment decodes with: `ModelSpec` (a checkpoint or a random preset) and loading.

  ModelSpec(checkpoint="gs://.../checkpoint_1000000", name="T5-XXL")  # T5X / Orbax / HF
  ModelSpec(preset="t5_1_1_tiny", config={"vocab_size": 259}, seed=0)  # random init
  ModelSpec(kind="ngram", options={"order": 2})                       # fit on the task

`load(spec, ...)` returns (model, params) for any registered `kind`: a draft head's
network registers its kind where it is defined (`checkpoints.heads.register`, e.g.
'eagle', 'mtp', 'medusa'), any other kind its loader with `register_kind`; the
experiment code does not change. Loaders receive a `LoadContext`: the role ('target' or
'draft'), the vocabulary size to match, a mesh, and a way to read the task's
token sequences (for drafters fit on data).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import spec_decode.heads  # noqa: F401  (every head network registers its checkpoint kind)
from spec_decode import configurable
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.checkpoints import storage
from spec_decode.models import offload, t5
from spec_decode.paths import resolve_checkpoint


SEED_LIMIT = 2 ** 32


def check_seed(name: str, seed) -> None:
  """A PRNG seed must be an int in [0, 2**32): `jax.random.PRNGKey` keeps 32 bits of it
  (without jax_enable_x64), so seeds 2**32 or -1 would silently give another seed's key."""
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise ValueError(f"{name} must be an int in [0, 2**32), got {seed!r}")
  if not 0 <= seed < SEED_LIMIT:
    raise ValueError(f"{name} must be an int in [0, 2**32), got {seed!r} (a larger or "
                     f"negative seed would silently repeat another seed's random stream)")


@configurable.register
@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model to load.

  kind: 't5', 'ngram', a draft head's kind ('eagle', 'mtp', 'medusa': a `checkpoints.heads`
    directory; each decodes with its own drafter) or any kind added with `register_kind`.
  checkpoint: path of a checkpoint (T5X legacy, T5X Orbax or Hugging Face dir).
  preset: a `T5Config` preset; without a checkpoint the model is randomly
    initialized from `seed`; with one, the loaded shapes must match it.
  config: T5Config field overrides on top of the preset (e.g. vocab_size).
  dtype: parameter/activation dtype name; None = bfloat16 on accelerators and
    float32 on CPU for checkpoints, float32 for random models.
  name: label in tables (default: preset or checkpoint directory name).
  options: kind-specific settings (ngram: order, split, num_examples, smoothing).
  allow_missing_chunks: read a T5X checkpoint's absent zarr chunks as zeros
    instead of refusing it (recorded in config.json / results.json when set).
  allow_outside_paths: accept checkpoint metadata naming files outside the
    checkpoint directory (T5X TensorStore paths, HF index shards).
  offload: t5 only: keep the parameters in host memory and stream them to the
    device layer by layer inside each call (`models.offload`), for a model larger
    than device memory (recorded in config.json / results.json when set).
  kernel_weights: t5 only: `T5.kernel_weights`, how the CPU decoding kernel stores the
    weights it packs ('auto', 'float32', 'bfloat16', 'int8', 'bfloat16_dot'; the last
    three change the model's function, 'bfloat16_dot' doubles the multiply-adds per
    instruction for compute-bound batches on CPUs with AVX512-BF16), or
    'bfloat16_dot_if_supported' ('bfloat16_dot' where the CPU has AVX512-BF16, else 'auto').
    Every decoder of the experiment uses the same model, so their comparison stays exact.
    Recorded when not 'auto'.
  setup_kernel_weights: t5 only: `T5.setup_kernel_weights`, the same for the weights only
    each example's set-up multiplies by (the encoder's, the cross-attention key/value):
    'same' (default), one of the above, or 'bfloat16_dot_if_supported'. Recorded when not
    'same'.
  """
  kind: str = "t5"
  checkpoint: str | None = None
  preset: str | None = None
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  seed: int = 0
  dtype: str | None = None
  name: str | None = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  allow_missing_chunks: bool = False
  allow_outside_paths: bool = False
  offload: bool = False
  kernel_weights: str = "auto"
  setup_kernel_weights: str = "same"

  def __post_init__(self):
    if not isinstance(self.kind, str) or not self.kind:
      raise ValueError(f"ModelSpec.kind must be a non-empty str, got {self.kind!r}")
    if self.checkpoint is not None and (not isinstance(self.checkpoint, (str, os.PathLike))
                                        or not os.fspath(self.checkpoint)):
      raise ValueError(f"ModelSpec.checkpoint must be a path, got {self.checkpoint!r}")
    if self.kind == "t5" and self.checkpoint is None and self.preset is None and not self.config:
      raise ValueError("a t5 ModelSpec needs a checkpoint, a preset or a config")
    if self.preset is not None and self.preset not in t5.PRESETS:
      raise ValueError(f"unknown T5 preset {self.preset!r}; known presets: {sorted(t5.PRESETS)}")
    check_seed("ModelSpec.seed", self.seed)
    if self.dtype is not None:
      try:
        dt = jnp.dtype(self.dtype)
      except TypeError as e:
        raise ValueError(f"ModelSpec.dtype {self.dtype!r} is not a dtype") from e
      if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"ModelSpec.dtype must be a floating dtype, got {self.dtype!r}")
    for name in ("allow_missing_chunks", "allow_outside_paths", "offload"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"ModelSpec.{name} must be True or False, got {getattr(self, name)!r}")
    if self.offload and self.kind != "t5":
      raise ValueError(f"ModelSpec.offload streams a T5's parameters from host memory; a "
                       f"{self.kind!r} model cannot be offloaded (use kind='t5')")
    if self.kernel_weights not in t5.KERNEL_WEIGHTS:
      raise ValueError(f"ModelSpec.kernel_weights must be one of {t5.KERNEL_WEIGHTS}, got "
                       f"{self.kernel_weights!r}")
    if self.setup_kernel_weights not in t5.SETUP_WEIGHTS:
      raise ValueError(f"ModelSpec.setup_kernel_weights must be one of {t5.SETUP_WEIGHTS}, "
                       f"got {self.setup_kernel_weights!r}")
    for name, default in (("kernel_weights", "auto"), ("setup_kernel_weights", "same")):
      if getattr(self, name) != default and self.kind != "t5":
        raise ValueError(f"ModelSpec.{name} sets how a T5's weights are packed for the CPU "
                         f"decoding kernel; a {self.kind!r} model has no such weights "
                         f"(leave it {default!r})")
    object.__setattr__(self, "config", dict(self.config))
    object.__setattr__(self, "options", dict(self.options))

  @property
  def label(self) -> str:
    if self.name:
      return self.name
    if self.checkpoint is not None:
      return os.path.basename(os.path.normpath(os.fspath(self.checkpoint))) or str(self.checkpoint)
    if self.kind == "ngram":
      return {1: "unigram", 2: "bigram"}.get(self.options.get("order"), "ngram")
    return self.preset or self.kind

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["checkpoint"] = None if self.checkpoint is None else os.fspath(self.checkpoint)
    for name in ("allow_missing_chunks", "allow_outside_paths", "offload"):
      if not d[name]:
        del d[name]  # recorded only when set, so older runs' config.json still match
    if d["kernel_weights"] == "auto":
      del d["kernel_weights"]
    if d["setup_kernel_weights"] == "same":
      del d["setup_kernel_weights"]
    return d


@dataclasses.dataclass(frozen=True)
class LoadContext:
  """What a loader may use besides the spec.

  role: 'target' or 'draft' (for messages). vocab_size: the vocabulary the
  model must have (the target's, for drafts), or None. mesh: optional
  jax.sharding.Mesh to load parameters into. target_sequences(split, n): token
  id sequences (targets, EOS-terminated) of the experiment's task.
  """
  role: str
  vocab_size: int | None = None
  mesh: Any = None
  target_sequences: Callable[[str, int | None], Sequence[Sequence[int]]] | None = None


Loader = Callable[[ModelSpec, LoadContext], tuple[Any, Any]]
_LOADERS: dict[str, Loader] = {}


def register_kind(kind: str, loader: Loader) -> None:
  """Makes ModelSpec(kind=kind) loadable: loader(spec, context) -> (model, params)."""
  _LOADERS[kind] = loader


def loader_of(spec: ModelSpec, role: str) -> Loader:
  """The loader of `spec.kind`; ValueError naming the role and the known kinds when no loader
  is registered for it (checked for every role before the first model loads, so that a
  misspelled draft kind is not found only after minutes of loading the target)."""
  if spec.kind in _LOADERS:
    return _LOADERS[spec.kind]
  if spec.kind in head_checkpoints.kinds():
    return _load_head
  raise ValueError(f"unknown model kind {spec.kind!r} for the {role}; "
                   f"known: {sorted(set(_LOADERS) | set(head_checkpoints.kinds()))}")


def load(spec: ModelSpec, context: LoadContext) -> tuple[Any, Any]:
  """(model, params) for `spec`: a `Decoder`, or a draft head its drafter reads."""
  if not isinstance(spec, ModelSpec):
    raise ValueError(f"{context.role} must be a ModelSpec, got {type(spec).__name__}")
  model, params = loader_of(spec, context.role)(spec, context)
  if context.vocab_size is not None and model.vocab_size != context.vocab_size:
    raise ValueError(f"the {context.role} ({spec.label}) has vocab_size {model.vocab_size}, "
                     f"expected {context.vocab_size}")
  return model, params


def checkpoint_fingerprint(spec: ModelSpec, *, small_file_bytes: int = 1 << 20) -> str | None:
  """A hash of what a local checkpoint holds, so a resumed run sees a retrained one
  (`checkpoints.storage.fingerprint`: paths, sizes, the content of small files). None for
  random models, n-grams and remote (URL) paths."""
  if spec.checkpoint is None:
    return None
  return storage.fingerprint(resolve_checkpoint(spec.checkpoint),
                             small_file_bytes=small_file_bytes)


def head_target_notice(draft: ModelSpec | None, target_fingerprint: str | None) -> str | None:
  """A sentence when `draft` is a head checkpoint trained on another target than the run's,
  whose `checkpoint_fingerprint` is target_fingerprint (the fingerprint
  `checkpoints.heads.save` recorded differs from it): such a head
  loads whenever the shapes fit and decodes exactly, but proposes for the wrong model, so its
  acceptance is near zero. None when they match or either is unknown."""
  if draft is None or draft.kind not in head_checkpoints.kinds() or draft.checkpoint is None:
    return None
  path = resolve_checkpoint(draft.checkpoint)
  if "://" in path:
    return None
  trained = head_checkpoints.trained_for(path) or {}
  recorded = trained.get("target_fingerprint")
  if recorded is None or target_fingerprint is None or recorded == target_fingerprint:
    return None
  return (f"the draft head {draft.checkpoint} was trained on the target "
          f"{trained.get('target_checkpoint')!r} (fingerprint {recorded}), not on this run's "
          f"target (fingerprint {target_fingerprint}): its proposals are for another model, "
          f"so expect a low acceptance rate (the outputs stay exact)")


def check_checkpoint(spec: ModelSpec, role: str) -> None:
  """Raises FileNotFoundError if the spec names a local checkpoint path that does not exist."""
  if spec.checkpoint is None:
    return
  path = resolve_checkpoint(spec.checkpoint)
  if "://" not in path and not os.path.exists(path):
    raise FileNotFoundError(f"{role} checkpoint not found: {os.path.abspath(path)}")


_SHAPE_FIELDS = ("vocab_size", "emb_dim", "num_heads", "num_encoder_layers",
                 "num_decoder_layers", "head_dim", "mlp_dim")


def _load_t5(spec: ModelSpec, context: LoadContext) -> tuple[t5.T5, dict]:
  expected = None
  if spec.preset is not None:
    expected = t5.T5Config.preset(spec.preset, **spec.config)
  elif spec.config:
    expected = t5.T5Config(**spec.config)
  if spec.checkpoint is None:
    model = t5.T5(expected.replace(dtype=jnp.dtype(spec.dtype or jnp.float32)))
    return _offloaded(spec, model, model.init(jax.random.PRNGKey(spec.seed)))
  check_checkpoint(spec, context.role)
  path = resolve_checkpoint(spec.checkpoint)
  from spec_decode import checkpoints
  config, params = checkpoints.load(path, dtype=spec.dtype, mesh=context.mesh,
                                    allow_missing_chunks=spec.allow_missing_chunks,
                                    allow_outside_paths=spec.allow_outside_paths,
                                    host_memory=spec.offload)
  if expected is not None:
    diff = {f: (getattr(config, f), getattr(expected, f)) for f in _SHAPE_FIELDS
            if getattr(config, f) != getattr(expected, f)}
    if diff:
      raise ValueError(f"the {context.role} checkpoint {path} does not match the preset/config "
                       f"of its ModelSpec: (checkpoint, spec) = {diff}")
  return _offloaded(spec, t5.T5(config), params)


def _offloaded(spec: ModelSpec, model: t5.T5, params) -> tuple[t5.T5, dict]:
  """(model, params) as loaded, with the spec's kernel weights, and streamed from host
  memory when `spec.offload` (a checkpoint is read there directly: `to_host` then copies
  nothing)."""
  model = dataclasses.replace(model, kernel_weights=spec.kernel_weights,
                              setup_kernel_weights=spec.setup_kernel_weights)
  if not spec.offload:
    return model, params
  return dataclasses.replace(model, stream_params=True), offload.to_host(params)


def _load_ngram(spec: ModelSpec, context: LoadContext):
  from spec_decode.models import ngram
  opts = dict(spec.options)
  unknown = set(opts) - {"order", "split", "num_examples", "smoothing"}
  if unknown:
    raise ValueError(f"unknown ngram options {sorted(unknown)} for the {context.role}")
  if spec.checkpoint is not None:
    raise ValueError("ngram drafts are fit on the task's data; they take no checkpoint")
  if context.vocab_size is None or context.target_sequences is None:
    raise ValueError(f"an ngram {context.role} needs the target's vocabulary and a task to fit on")
  order = opts.get("order", 2)
  sequences = context.target_sequences(opts.get("split", "train"), opts.get("num_examples"))
  model = ngram.NGramDecoder(vocab_size=context.vocab_size, order=order)
  params = ngram.fit(sequences, order=order, vocab_size=context.vocab_size,
                     smoothing=float(opts.get("smoothing", 0.0)))
  return model, params


def _load_head(spec: ModelSpec, context: LoadContext):
  """A draft head of a registered kind (`checkpoints.heads`: EAGLE, MTP, Medusa), which
  decodes with its own drafter."""
  if spec.checkpoint is None or spec.preset is not None or spec.config or spec.options:
    raise ValueError(f"a {spec.kind} {context.role} is a head checkpoint: give "
                     "ModelSpec.checkpoint only (no preset, config or options)")
  check_checkpoint(spec, context.role)
  return head_checkpoints.load(resolve_checkpoint(spec.checkpoint), kind=spec.kind,
                               dtype=spec.dtype)


register_kind("t5", _load_t5)
register_kind("ngram", _load_ngram)
