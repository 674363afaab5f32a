"""Training an EAGLE head on a frozen target (EAGLE-1 losses + EAGLE-3's training-time test).

    python -m spec_decode.heads.train_eagle --gin_file=configs/demo/ende_eagle.gin

The frozen target is run teacher-forced on each batch's decoder inputs s_0 ..
s_{T-1} (the task's targets, or the target's own greedy outputs with
prefixes='target'), giving its final decoder states f_0 .. f_{T-1} and its
next-token laws p_0 .. p_{T-1}. Unroll step j = 1 .. k feeds the head, at
query i (sequence position i + j - 1), the pair (feature, s_{i+j}) where the
feature is f_i at step 1 and the head's own step j - 1 prediction at query i
afterwards, and asks for f_{i+j}:

  loss_j = smooth_l1(f'_{i+j}, f_{i+j}) + ce_weight * CE(p_{i+j}, LM(f'_{i+j}))
  loss   = sum_j unroll_decay^(j-1) loss_j / sum_j unroll_decay^(j-1)

Step j's query i attends to step 1's entries at positions <= i (the true
features a drafting head's cache holds) and to its own chain's entries of steps
2 .. j at query i: exactly what the head sees when it drafts j tokens ahead
(EAGLE-3's "training-time test"). Step 1 alone is EAGLE-1.

The train state is checkpointed in `workdir` with Orbax (runs resume exactly:
batches are a function of the step); the final head is written with
`checkpoints.heads.save` (T5X format plus its config).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

from spec_decode import train, train_data
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.heads import eagle
from spec_decode.models import t5


@dataclasses.dataclass(frozen=True)
class HeadTrainConfig:
  """What every run training a head on a frozen target sets (EAGLE, MTP modules).

  head: overrides of the head config's `for_target` defaults. prefixes: 'data'
  (the task's targets) or 'target' (its greedy outputs for the first
  teacher_examples training inputs).
  """
  task: str = "synthetic_ende"
  target_checkpoint: str = "demo_models/ende_target"
  head: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  prefixes: str = "data"
  teacher_examples: int = 1024
  teacher_temperature: float = 0.0
  optimizer: str = "adamw"
  learning_rate: float = 1e-3
  warmup_steps: int = 20
  schedule: str = "cosine"
  weight_decay: float = 0.0
  batch_size: int = 32
  num_steps: int = 200
  input_length: int = 64
  target_length: int = 64
  max_train_examples: Optional[int] = None
  seed: int = 0
  workdir: Optional[str] = None
  save_every: int = 100
  eval_every: int = 100
  eval_examples: int = 128
  log_every: int = 25
  export_path: Optional[str] = None
  export_dtype: str = "float32"

  _positive_ints = ("batch_size", "input_length", "target_length", "save_every", "eval_every",
                    "log_every", "teacher_examples")

  def __post_init__(self):
    name = type(self).__name__
    if self.prefixes not in train.PREFIXES:
      raise ValueError(f"{name}.prefixes must be one of {train.PREFIXES}, got {self.prefixes!r}")
    if self.optimizer not in train.OPTIMIZERS or self.schedule not in train.SCHEDULES:
      raise ValueError(f"{name}.optimizer must be in {train.OPTIMIZERS} and schedule "
                       f"in {train.SCHEDULES}, got {self.optimizer!r}, {self.schedule!r}")
    for field in self._positive_ints:
      v = getattr(self, field)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}.{field} must be an int >= 1, got {v!r}")
    if self.num_steps < 0 or self.warmup_steps < 0 or self.learning_rate <= 0:
      raise ValueError(f"{name} needs num_steps >= 0, warmup_steps >= 0, learning_rate > 0")


@dataclasses.dataclass(frozen=True)
class EagleTrainConfig(HeadTrainConfig):
  """An EAGLE head-training run (`HeadTrainConfig` plus the losses' settings).

  unroll: k, the training-time-test steps (1 = EAGLE-1); unroll_decay: the
  weight ratio of step j + 1 to step j; ce_weight: the cross-entropy term's
  weight.
  """
  unroll: int = 3
  unroll_decay: float = 0.8
  ce_weight: float = 0.1

  _positive_ints = HeadTrainConfig._positive_ints + ("unroll",)

  def __post_init__(self):
    super().__post_init__()
    if not 0.0 < self.unroll_decay <= 1.0 or self.ce_weight < 0:
      raise ValueError(f"EagleTrainConfig needs 0 < unroll_decay <= 1 and ce_weight >= 0, got "
                       f"{self.unroll_decay}, {self.ce_weight}")


# ----------------------------------------------------------------------------- loss
def target_features(target: t5.T5, target_params, encoder_tokens, decoder_inputs):
  """(encoded, features [B, T, D], log p [B, T, V]) of the frozen target, teacher-forced."""
  encoded = target.encode(target_params, encoder_tokens)
  cache = target.init_cache(target_params, encoded, decoder_inputs.shape[1])
  out = target.decode(target_params, cache, decoder_inputs)
  return (jax.lax.stop_gradient(encoded), jax.lax.stop_gradient(out.hidden),
          jax.lax.stop_gradient(jax.nn.log_softmax(out.logits, axis=-1)))


def shift_left(x, j: int):
  """x[:, i + j] at index i, zeros past the end (axis 1)."""
  if j == 0:
    return x
  pad = jnp.zeros_like(x[:, :j])
  return jnp.concatenate([x[:, j:], pad], axis=1)


def _unroll_geometry(head: eagle.EagleHead, params, j: int, T: int, k: int, B: int):
  """(bias, mask) of unroll step j's T queries over a k*T-slot buffer (see the module doc)."""
  i_q = jnp.arange(T)[:, None]
  slot = jnp.arange(k * T)[None, :]
  level, i_k = slot // T + 1, slot % T  # the step that wrote a slot, and its query index
  visible = jnp.where(level == 1, i_k <= i_q, (level <= j) & (i_k == i_q))
  rel = (i_k + level - 1) - (i_q + j - 1)  # key position - query position
  bias = head.block._relpos_bias(params["relpos_bias"]["rel_embedding"], rel,
                                 bidirectional=False)  # [N, T, kT]
  return (jnp.broadcast_to(bias[None], (B,) + bias.shape),
          jnp.broadcast_to(visible[None], (B, T, k * T)))


def unrolled_predictions(head: eagle.EagleHead, params, encoded, features_BTD, embed_fn,
                         decoder_inputs, k: int):
  """[k] predictions [B, T, D]: step j's query i predicts f_{i+j} (see the module doc)."""
  c = head.config
  B, T, _ = features_BTD.shape
  cache = head.init_cache(params, encoded, k * T)
  cross_mask = jnp.broadcast_to(cache.encoder_mask[:, None, :],
                                (B, T, cache.encoder_mask.shape[1]))
  self_k, self_v = cache.self_k[0], cache.self_v[0]
  feats, preds = features_BTD, []
  for j in range(1, k + 1):
    f = t5._rms_norm(feats.astype(c.dtype), params["feature_norm"]["scale"],
                     c.layer_norm_epsilon)
    e = t5._rms_norm(embed_fn(shift_left(decoder_inputs, j)).astype(c.dtype),
                     params["token_norm"]["scale"], c.layer_norm_epsilon)
    x = jnp.einsum("BTE,ED->BTD", jnp.concatenate([f, e], axis=-1),
                   params["fc"]["kernel"].astype(c.dtype))
    bias, mask = _unroll_geometry(head, params, j, T, k, B)
    offsets = jnp.full((B,), (j - 1) * T, jnp.int32)
    x, self_k, self_v = head.block.decoder_layer(
        params["layers_0"], x, self_k, self_v, offsets, bias, mask, cache.cross_k[0],
        cache.cross_v[0], cross_mask)
    feats = t5._rms_norm(x, params["final_norm"]["scale"], c.layer_norm_epsilon)
    preds.append(feats)
  return preds


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


def eagle_loss(head, params, target, target_params, batch, *, unroll: int, unroll_decay: float,
               ce_weight: float):
  """(loss, metrics) of one batch; see the module doc."""
  dec_in = batch["decoder_inputs"]
  encoded, feats, logp = target_features(target, target_params, batch["encoder_tokens"], dec_in)
  w = batch["weights"]
  embed_fn = lambda tokens: target.embed(target_params, tokens)
  preds = unrolled_predictions(head, params, encoded, feats, embed_fn, dec_in, unroll)
  total, norm, metrics = 0.0, 0.0, {}
  for j, pred in enumerate(preds, start=1):
    wj = shift_left(w, j)
    n = jnp.maximum(jnp.sum(wj), 1.0)
    want = shift_left(feats, j).astype(jnp.float32)
    reg = jnp.sum(jnp.mean(optax.huber_loss(pred.astype(jnp.float32), want), axis=-1) * wj) / n
    terms = distill_terms(target, target_params, pred, shift_left(logp, j), wj)
    weight = unroll_decay ** (j - 1)
    total, norm = total + weight * (reg + ce_weight * terms["ce"]), norm + weight
    metrics.update({f"reg_{j}": reg, f"ce_{j}": terms["ce"], f"agree_{j}": terms["agree"]})
  metrics["tokens"] = jnp.sum(w)
  return total / norm, metrics


def make_steps(loss_fn, optimizer):
  """(train_step(state, batch, target_params), eval_step(params, batch, target_params)) of
  loss_fn(params, target_params=..., batch=...) -> (loss, metrics)."""

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state: train.TrainState, batch, target_params):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: loss_fn(p, target_params=target_params, batch=batch), has_aux=True)(
            state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return train.TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state), metrics

  @jax.jit
  def eval_step(params, batch, target_params):
    loss, metrics = loss_fn(params, target_params=target_params, batch=batch)
    return dict(metrics, loss=loss)
  return train_step, eval_step


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True)
class HeadTrainResult:
  head: Any
  params: Any
  history: tuple
  eval: Mapping[str, float]
  seconds: float



@dataclasses.dataclass(frozen=True)
class HeadRecipe:
  """How to train one kind of head: what: its name in reports; build(target) -> head;
  loss(head, params, target=, target_params=, batch=) -> (loss, metrics); describe(metrics)
  -> a log line's tail; save(path, head, params, step=, dtype=)."""
  what: str
  build: Callable[[t5.T5], Any]
  loss: Callable[..., Any]
  describe: Callable[[Mapping[str, float]], str]
  save: Callable[..., None]


def train_frozen_head(cfg: HeadTrainConfig, recipe: HeadRecipe, *,
                      report: Callable[[str], None] = print,
                      train_split: train_data.TokenizedSplit | None = None,
                      eval_split: train_data.TokenizedSplit | None = None,
                      target: t5.T5 | None = None, target_params=None) -> HeadTrainResult:
  """Runs (or resumes from cfg.workdir) cfg.num_steps steps of training a head on a frozen
  target, then exports it to cfg.export_path.

  train_split / eval_split / (target, target_params) override the task's data and
  `target_checkpoint` (tests pass tiny ones).
  """
  if cfg.export_path and os.path.isdir(cfg.export_path) and os.listdir(cfg.export_path):
    raise ValueError(f"export_path {cfg.export_path} already holds files; remove it first")
  if target is None:
    from spec_decode import checkpoints, model_specs
    tcfg, target_params = checkpoints.load(model_specs.resolve_checkpoint(cfg.target_checkpoint),
                                           dtype="float32")
    target = t5.T5(tcfg)
  if train_split is None or eval_split is None:
    from spec_decode.data import synthetic_tasks
    source = synthetic_tasks.offline_source(cfg.task)
    if train_split is None:
      train_split = source.tokenized("train", cfg.max_train_examples)
    if eval_split is None:
      eval_split = source.tokenized("validation", cfg.eval_examples)
  if cfg.prefixes == "target":
    train_split = train._teacher_split(target, target_params, train_split, cfg, report)
  head = recipe.build(target)
  head.check_target(target)
  report(f"{recipe.what}: {head.num_params():,} parameters (target {target.num_params():,}); "
         f"{len(train_split)} training examples")
  params = head.init(jax.random.PRNGKey(cfg.seed))
  optimizer = train.make_optimizer(cfg)
  state = train.TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))
  state, manager = train.resume(state, cfg, report)
  train_step, eval_step = make_steps(functools.partial(recipe.loss, head, target=target),
                                     optimizer)
  t0 = time.time()
  state, history, last_eval = train.run_steps(
      state, cfg, train_step=train_step, eval_step=eval_step, train_split=train_split,
      eval_split=eval_split, frozen_params=target_params, manager=manager, report=report,
      describe=recipe.describe)
  seconds = time.time() - t0
  report(f"trained to step {int(state.step)} in {seconds / 60:.1f} minutes")
  if cfg.export_path:
    recipe.save(cfg.export_path, head, state.params, step=int(state.step), dtype=cfg.export_dtype)
    report(f"exported the {recipe.what} to {cfg.export_path}")
  return HeadTrainResult(head=head, params=state.params, history=tuple(history),
                         eval=last_eval, seconds=seconds)


def train_head(cfg: EagleTrainConfig, **kw) -> HeadTrainResult:
  """Trains an EAGLE head (`train_frozen_head`'s keyword arguments)."""
  recipe = HeadRecipe(
      what="EAGLE head",
      build=lambda target: eagle.EagleHead(eagle.EagleConfig.for_target(target.config,
                                                                         **dict(cfg.head))),
      loss=functools.partial(eagle_loss, unroll=cfg.unroll, unroll_decay=cfg.unroll_decay,
                             ce_weight=cfg.ce_weight),
      describe=lambda m: (f"loss {m['loss']:.4f} reg_1 {m['reg_1']:.4f} agree_1 "
                          f"{m['agree_1']:.3f} agree_{cfg.unroll} "
                          f"{m[f'agree_{cfg.unroll}']:.3f}"),
      save=head_checkpoints.save)
  return train_frozen_head(cfg, recipe, **kw)


def run_cli() -> None:
  """`python -m spec_decode.heads.train_eagle --gin_file=... [--gin.NAME=VALUE]`."""
  from spec_decode import gin_config
  gin_config.run_trainer("spec_decode.heads.train_eagle", EagleTrainConfig, "EagleTrainConfig",
                         "configs/demo/ende_eagle.gin",
                         lambda cfg: train_head(cfg, report=lambda s: print(s, flush=True)))


if __name__ == "__main__":
  from spec_decode.heads import train_eagle as _train_eagle
  _train_eagle.run_cli()
