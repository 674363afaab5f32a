"""Training a draft head on a frozen target: the head recipes' shared run, on the one trainer.

A recipe (`HeadRecipe`: `train.eagle`, `train.mtp`, `train.medusa`) says how to build
its head for the target, its loss on a batch and how a log line reads; `train_head`
does the rest for every kind: load the frozen target, read the task's data (or the
target's own outputs, prefixes='target'), run `trainer.run_steps` (resumable from
cfg.workdir) and export the head in the one format of draft heads
(`checkpoints.heads`). The helpers the recipes' losses share are here too: the
target's teacher-forced features and laws, and distillation terms through its LM head.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from spec_decode import paths
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.checkpoints import storage
from spec_decode.data.tokenized import TokenizedSplit
from spec_decode.models import t5
from spec_decode.train import trainer


@dataclasses.dataclass(frozen=True)
class HeadTrainConfig(trainer.RunConfig):
  """A run training a head on a frozen target (EAGLE, MTP, Medusa): the trainer's settings
  (`trainer.RunConfig`, with defaults for heads) and the target; each recipe's config adds
  its own settings and `run` (`train.eagle`, `train.mtp`, `train.medusa`).

  target_checkpoint: the frozen target. head: overrides of the head config's `for_target`
  defaults. With prefixes 'target' both splits are the target's own outputs (the first
  teacher_examples training and eval_examples validation inputs decoded by it).

  A recipe's config names its head config class in `_head_config` (None: `head` is not
  checked), in `_head_settings` the head config fields its own settings set ({field:
  setting}) and in `_head_fixed` those it takes from the target whatever `head` says;
  `head`'s keys are checked against the other fields when the config is built, since
  `for_target(**head)` would raise a bare TypeError only after the target is loaded.
  """
  target_checkpoint: str = "demo_models/ende_target"
  head: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  prefixes: str = "data"
  teacher_examples: int = 1024
  warmup_steps: int = 20
  batch_size: int = 32
  num_steps: int = 200
  save_every: int = 100
  eval_every: int = 100
  eval_examples: int = 128
  log_every: int = 25
  export_dtype: str = "float32"

  _head_config = None
  _head_settings = {}  # {head config field: the setting of this config that sets it}
  _head_fixed = ()  # head config fields the recipe takes from the target, not from `head`

  def __post_init__(self):
    super().__post_init__()
    self._check_head()

  def _check_head(self) -> None:
    """A ValueError unless `head` is a dict whose keys are fields of `_head_config` that no
    setting of this config sets: one naming the setting to use for a key a setting sets, else
    one naming the unknown keys and listing the valid ones."""
    name = type(self).__name__
    if not isinstance(self.head, Mapping):
      raise ValueError(f"{name}.head must be a dict of head config fields, got {self.head!r}")
    if self._head_config is None:
      return
    for key, setting in self._head_settings.items():
      if key in self.head:
        raise ValueError(f"set {name}.{setting}, not head[{key!r}]")
    valid = [f.name for f in dataclasses.fields(self._head_config)
             if f.name not in self._head_settings and f.name not in self._head_fixed]
    unknown = [k for k in self.head if k not in valid]
    if unknown:
      raise ValueError(f"{name}.head has unknown keys {unknown}; valid keys (fields of "
                       f"{self._head_config.__name__}): {valid or 'none'}")


# ----------------------------------------------------------------------------- loss helpers
def target_features(target: t5.T5, target_params, encoder_tokens, decoder_inputs,
                    layers: tuple[int, ...] = ()):
  """(encoded, features [B, T, D], log p [B, T, V]) of the frozen target, teacher-forced;
  with `layers`, features [B, T, D * (1 + len(layers))]: the final states, then the residual
  streams after those decoder layers (as the verify call gives them to a drafter)."""
  encoded = target.encode(target_params, encoder_tokens)
  cache = target.init_cache(target_params, encoded, decoder_inputs.shape[1])
  out = target.decode(target_params, cache, decoder_inputs, layers=layers)
  hidden = jnp.concatenate([out.hidden, out.features], -1) if layers else out.hidden
  return (jax.lax.stop_gradient(encoded), jax.lax.stop_gradient(hidden),
          jax.lax.stop_gradient(jax.nn.log_softmax(out.logits, axis=-1)))


def shift_left(x, j: int):
  """x[:, i + j] at index i, zeros past the end (axis 1)."""
  if j == 0:
    return x
  pad = jnp.zeros_like(x[:, :j])
  return jnp.concatenate([x[:, j:], pad], axis=1)


def distill_terms(target: t5.T5, target_params, hidden_BTD, logp_BTV, weights_BT):
  """{ce, kl, agree}: the cross-entropy of the target's LM head on `hidden` against the laws
  exp(logp), the KL divergence (the same minus the laws' entropy: the same gradients,
  0 at a perfect fit) and the fraction whose argmax agrees; weighted means over positions."""
  n = jnp.maximum(jnp.sum(weights_BT), 1.0)
  mean = lambda x: jnp.sum(x * weights_BT) / n
  logits = target.logits_from_hidden(target_params, hidden_BTD)
  p_want = jnp.exp(logp_BTV)
  ce = mean(-jnp.sum(p_want * jax.nn.log_softmax(logits, axis=-1), axis=-1))
  entropy = mean(-jnp.sum(p_want * logp_BTV, axis=-1))
  agree = mean(jnp.argmax(logits, -1) == jnp.argmax(logp_BTV, -1))
  return {"ce": ce, "kl": ce - entropy, "agree": agree}


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True)
class HeadTrainResult:
  """head and its trained params; history: logged metric dicts; eval: the last eval
  metrics; seconds: the step loop's wall time."""
  head: Any
  params: Any
  history: tuple
  eval: Mapping[str, float]
  seconds: float


@dataclasses.dataclass(frozen=True)
class HeadRecipe:
  """How to train one kind of head: what: its name in reports; build(target) -> head;
  loss(head, params, target=, target_params=, batch=) -> (loss, metrics); describe(metrics)
  -> a log line's tail; init(head, rng, target, target_params) -> the starting params
  (None: the head's random init)."""
  what: str
  build: Callable[[t5.T5], Any]
  loss: Callable[..., Any]
  describe: Callable[[Mapping[str, float]], str]
  init: Callable[..., Any] | None = None


def train_head(cfg: HeadTrainConfig, recipe: HeadRecipe, *,
                      report: Callable[[str], None] = print,
                      train_split: TokenizedSplit | None = None,
                      eval_split: TokenizedSplit | None = None,
                      target: t5.T5 | None = None, target_params=None) -> HeadTrainResult:
  """Runs (or resumes from cfg.workdir) cfg.num_steps steps of training the head `recipe`
  builds on a frozen target, then exports it to cfg.export_path (`checkpoints.heads`).

  train_split / eval_split / (target, target_params) override the task's data and
  `target_checkpoint` (tests pass tiny ones). A head trained on `target_checkpoint` records
  it and its fingerprint in the export (`checkpoints.heads.TRAINED_FOR`).
  """
  if cfg.export_path and os.path.isdir(cfg.export_path) and os.listdir(cfg.export_path):
    raise ValueError(f"export_path {cfg.export_path} already holds files; remove it first")
  trained_for = None  # what the export records of its target: only a loaded checkpoint
  if target is None:
    from spec_decode import checkpoints
    target_path = paths.resolve_checkpoint(cfg.target_checkpoint)
    trained_for = {"target_checkpoint": cfg.target_checkpoint,
                   "target_fingerprint": storage.fingerprint(target_path)}
    tcfg, target_params = checkpoints.load(target_path, dtype="float32")
    target = t5.T5(tcfg)
  train_split, eval_split = trainer.splits(cfg, train_split, eval_split)
  if cfg.prefixes == "target":
    train_split = trainer.teacher_split(target, target_params, train_split, cfg, report)
    eval_split = trainer.teacher_split(target, target_params, eval_split, cfg, report,
                                       num_examples=cfg.eval_examples, what="evaluation")
  head = recipe.build(target)
  head.check_target(target)
  report(f"{recipe.what}: {head.num_params():,} parameters (target {target.num_params():,}); "
         f"{len(train_split)} training examples")
  rng = jax.random.PRNGKey(cfg.seed)
  params = head.init(rng) if recipe.init is None else recipe.init(head, rng, target,
                                                                  target_params)
  optimizer = trainer.make_optimizer(cfg)
  state = trainer.TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))
  state, manager = trainer.resume(state, cfg, report)
  train_step, eval_step = trainer.make_steps(functools.partial(recipe.loss, head, target=target),
                                             optimizer)
  t0 = time.time()
  state, history, last_eval = trainer.run_steps(
      state, cfg, train_step=train_step, eval_step=eval_step, train_split=train_split,
      eval_split=eval_split, frozen_params=target_params, manager=manager, report=report,
      describe=recipe.describe)
  seconds = time.time() - t0
  report(f"trained to step {int(state.step)} in {seconds / 60:.1f} minutes")
  if cfg.export_path:
    head_checkpoints.save(cfg.export_path, head, state.params, step=int(state.step),
                          dtype=cfg.export_dtype, trained_for=trained_for)
    report(f"exported the {recipe.what} to {cfg.export_path}")
  return HeadTrainResult(head=head, params=state.params, history=tuple(history),
                         eval=last_eval, seconds=seconds)
