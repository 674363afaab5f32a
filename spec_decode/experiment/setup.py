"""What a run loads and decodes with: its task, examples, models and mesh (`load`), each
configured decoder as a function of a batch (`decode_fns`), and a batch's inputs.

Every process of a multi-process run loads and decodes; only process 0 writes files
(`is_writer`) and its view decides (`broadcast`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from spec_decode import data, decoding, distributed, partitioning
from spec_decode.decoding import footprint, runner
from spec_decode.experiment import batching, model_specs
from spec_decode.experiment.config import ExperimentConfig
from spec_decode.experiment.model_specs import LoadContext


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything loaded for a run: its config, task and examples, models and mesh."""
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


def is_writer() -> bool:
  """Only process 0 writes files (all processes decode)."""
  return jax.process_index() == 0


def load(config: ExperimentConfig, *, status: Callable[[str], None] = lambda msg: None
         ) -> Setup:
  """Resolves the task, examples, mesh and models (local checkpoint paths checked first).

  status(message) is told what is being loaded (the command line prints it).
  """
  roles = ("target",) if config.draft is None else ("target", "draft")
  for role in roles:
    model_specs.loader_of(getattr(config, role), role)  # an unknown kind, before any loading
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
  check_memory(config, examples, target, draft, mesh)
  return Setup(config, task, tuple(examples), target, tparams, draft, dparams, mesh)


def check_memory(config: ExperimentConfig, examples, target, draft, mesh) -> None:
  """Refuses (`footprint.DecodeMemoryError`), before any batch is built, a configuration
  whose decodes cannot fit in the memory of the devices in use: every configured algorithm
  at the batch size (with refill, twice it: the rows that wait to enter are held beside
  the slots), with the longest input among the examples."""
  input_len = runner.length_bucket(max((len(ex.input_tokens) for ex in examples), default=1),
                                   config.feature_lengths["inputs"])
  devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
  for algorithm in config.algorithms.values():
    footprint.check_fits(algorithm, target, draft if algorithm.needs_draft else None,
                         batch=config.batch_size * (2 if config.refill_chunk else 1),
                         input_len=input_len,
                         draft_input_len=input_len, max_decode_len=config.decode_len,
                         devices=devices)


def decode_fns(s: Setup) -> dict[str, Callable[[jax.Array, jax.Array], decoding.DecodeResult]]:
  """{name: (encoder tokens, row ids) -> DecodeResult}, one per configured algorithm."""
  cfg = s.config
  common = dict(max_decode_len=cfg.decode_len, sampling=cfg.sampling,
                rng=jax.random.PRNGKey(cfg.seed))
  if s.mesh is not None:
    common.update(mesh=s.mesh, rules=cfg.rules)
  else:
    common.update(compiler_options=cfg.compiler_options)
    if cfg.refill_chunk:
      common.update(refill_batch=cfg.batch_size)

  def make(algorithm):
    drafts = dict(draft=s.draft, draft_params=s.draft_params) if algorithm.needs_draft else {}
    return lambda enc, ids: decoding.run(algorithm, s.target, s.target_params, enc,
                                         row_ids=ids, **drafts, **common)
  return {name: make(a) for name, a in cfg.algorithms.items()}


def call_rows(s: Setup) -> int:
  """Examples per decode call: the batch size, or with refill (`refill_chunk`) that many
  batches' worth decoded in batch_size slots."""
  return s.config.batch_size * max(s.config.refill_chunk, 1)


def inputs(s: Setup, batch: Sequence[data.Example], rows: int | None = None
           ) -> tuple[jax.Array, jax.Array]:
  """A decode call's encoder tokens [B, S] and row ids [B] (the example indices), padded to
  `rows` (default `call_rows`) by repeating the last example, laid out on the mesh when
  there is one."""
  cfg = s.config
  B = call_rows(s) if rows is None else rows
  enc, ids = batching.example_batch(batch, batch_size=B,
                                    input_length=cfg.feature_lengths["inputs"])
  if s.mesh is None:
    return jnp.asarray(enc), jnp.asarray(ids)
  # Each process feeds only the rows its devices hold (all of them on one host).
  rows = distributed.process_rows(s.mesh, B)
  return (distributed.global_batch(enc[rows], s.mesh, B),
          distributed.global_batch(ids[rows], s.mesh, B))


def broadcast(x):
  """Process 0's value of a numpy array or scalar on every process (identity on one)."""
  if jax.process_count() == 1:
    return x
  from jax.experimental import multihost_utils
  return multihost_utils.broadcast_one_to_all(x)
