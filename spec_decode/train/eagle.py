"""Training an EAGLE head on a frozen target (EAGLE-1 losses + EAGLE-3's training-time test;
with `head={'fuse_layers': (i, j)}` also EAGLE-3's multi-layer feature fusion).

    python -m spec_decode.cli.train --gin_file=configs/demo/ende_eagle.gin

The frozen target is run teacher-forced on each batch's decoder inputs s_0 ..
s_{T-1} (the task's targets, or the target's own greedy outputs with
prefixes='target'), giving its final decoder states f_0 .. f_{T-1} and its
next-token laws p_0 .. p_{T-1}. Unroll step j = 1 .. k feeds the head, at
query i (sequence position i + j - 1), the pair (feature, s_{i+j}) where the
feature is f_i at step 1 and the head's own step j - 1 prediction at query i
afterwards, and asks for f_{i+j}:

  loss_j = feature_weight * smooth_l1(f'_{i+j}, f_{i+j}) + ce_weight * CE(p_{i+j}, LM(f'_{i+j}))
  loss   = sum_j unroll_decay^(j-1) loss_j / sum_j unroll_decay^(j-1)

A head with a learned start (head={'start_feature': True}) also predicts f_0 from
the pair (its start vector, e(s_0)) alone (`EagleHead.start_prediction`), a term
  loss_0 = feature_weight * smooth_l1(f'_0, f_0) + ce_weight * CE(p_0, LM(f'_0))
of weight 1 beside the unroll steps' (normalized with them), and is trained on the
chain a row's first call drafts from it (`start_chain`): step j = 1 .. k feeds the
pair (f'_{j-1}, s_j) at position j - 1 over a cache holding only the chain's own
entries, and asks for f_j (terms 's1' .. 'sk', weighted first_draft_weight times the
unroll's steps). The unroll never shows the head that input: its step-1 queries read
true (or, with fusion, fused) features and its later steps see the true pairs before
them. A fused head trained without it accepted 2.4 of the 4 tokens of its first draft
on 50 EnDe test examples, the final-state head 3.7 (demo_models/README.md).

EAGLE-1 regresses the target's features (feature_weight 1, ce_weight 0.1 in its
recipe); EAGLE-3 drops that constraint and trains on the target's next-token laws
alone (feature_weight 0, ce_weight 1), so a head fed fused low/middle/high states is
free to carry more than the final state in its own outputs.

Step j's query i attends to step 1's entries at positions <= i (the true
features a drafting head's cache holds) and to its own chain's entries of steps
2 .. j at query i: exactly what the head sees when it drafts j tokens ahead
(EAGLE-3's "training-time test"). Step 1 alone is EAGLE-1.

A recipe on the shared head trainer (`train.heads.train_head`): the train state is
checkpointed in `workdir` (runs resume exactly) and the head is exported in the one
format of draft heads (`checkpoints.heads`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import optax

from spec_decode import configurable
from spec_decode.heads import eagle
from spec_decode.models import t5
from spec_decode.train import trainer
from spec_decode.train.heads import (HeadRecipe, HeadTrainConfig, HeadTrainResult, distill_terms,
                                     shift_left, target_features, train_head)


@configurable.register(runnable=True)
@dataclasses.dataclass(frozen=True)
class EagleTrainConfig(HeadTrainConfig):
  """An EAGLE head-training run (`HeadTrainConfig` plus the losses' settings).

  unroll: k, the training-time-test steps (1 = EAGLE-1); unroll_decay: the
  weight ratio of step j + 1 to step j; feature_weight and ce_weight: the weights
  of the feature regression and of the cross-entropy against the target's laws
  (EAGLE-3: 0 and 1); first_draft_weight: with a learned start, the weight of the
  first draft's chain terms relative to the unroll's (0: not trained, the loss of the
  heads trained before it, e.g. cnndm_big_eagle).
  """
  unroll: int = 3
  unroll_decay: float = 0.8
  ce_weight: float = 0.1
  feature_weight: float = 1.0
  first_draft_weight: float = 1.0

  _positive_ints = HeadTrainConfig._positive_ints + ("unroll",)
  _head_config = eagle.EagleConfig

  def __post_init__(self):
    super().__post_init__()
    trainer.check_real(self, "unroll_decay", "a number in (0, 1]", lambda v: 0 < v <= 1)
    trainer.check_real(self, "ce_weight", "a finite number >= 0", lambda v: v >= 0)
    trainer.check_real(self, "feature_weight", "a finite number >= 0", lambda v: v >= 0)
    trainer.check_real(self, "first_draft_weight", "a finite number >= 0", lambda v: v >= 0)
    if self.ce_weight + self.feature_weight == 0:
      raise ValueError("EagleTrainConfig: ce_weight and feature_weight are both 0, so the loss "
                       "is 0 and the head would not train")

  def run(self, **kw) -> HeadTrainResult:
    """Trains an EAGLE head (`train`): what the command line runs with this config."""
    return train(self, **kw)


# ----------------------------------------------------------------------------- loss
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


def start_chain(head: eagle.EagleHead, params, encoded, embed_fn, decoder_inputs, k: int):
  """[k + 1] predictions [B, 1, D] of f_0 .. f_k along a row's first draft: f'_0 from the
  learned start, then step j fed (f'_{j-1}, e(s_j)) at position j - 1 (see the module doc),
  as `EagleDrafter.propose` runs them when nothing is committed yet."""
  cache = head.init_cache(params, encoded, max(k, 1))  # start_prediction steps in one slot
  feature = head.start_prediction(params, cache, embed_fn(decoder_inputs[:, :1]))[:, None]
  preds = [feature]
  for j in range(1, k + 1):
    feature, cache = head.step(params, cache, feature, embed_fn(decoder_inputs[:, j:j + 1]))
    preds.append(feature)
  return preds


def eagle_loss(head, params, target, target_params, batch, *, unroll: int, unroll_decay: float,
               ce_weight: float, feature_weight: float = 1.0, first_draft_weight: float = 1.0):
  """(loss, metrics) of one batch; see the module doc."""
  dec_in = batch["decoder_inputs"]
  encoded, hidden, logp = target_features(target, target_params, batch["encoder_tokens"],
                                          dec_in, head.target_layers)
  feats = hidden[..., :head.d_model]  # the final states: what the head's predictions match
  w = batch["weights"]
  embed_fn = lambda tokens: target.embed(target_params, tokens)
  preds = unrolled_predictions(head, params, encoded, head.target_input(params, hidden),
                               embed_fn, dec_in, unroll)
  # (name, step, predictions [B, T, D] of f_{i+step}, weight): '0' is the start's f_0,
  # 's<j>' the first draft's chain from it (T = 1: query 0 predicts f_j).
  steps = [(str(j), j, pred, unroll_decay ** (j - 1)) for j, pred in enumerate(preds, start=1)]
  if head.has_start:
    k = min(unroll, dec_in.shape[1] - 1) if first_draft_weight else 0
    chain = start_chain(head, params, encoded, embed_fn, dec_in, k)
    steps.insert(0, ("0", 0, chain[0], 1.0))
    steps += [(f"s{j}", j, pred, first_draft_weight * unroll_decay ** (j - 1))
              for j, pred in enumerate(chain[1:], 1)]
  total, norm, metrics = 0.0, 0.0, {}
  for name, j, pred, weight in steps:
    T = pred.shape[1]
    wj = shift_left(w, j)[:, :T]
    n = jnp.maximum(jnp.sum(wj), 1.0)
    want = shift_left(feats, j)[:, :T].astype(jnp.float32)
    reg = jnp.sum(jnp.mean(optax.huber_loss(pred.astype(jnp.float32), want), axis=-1) * wj) / n
    terms = distill_terms(target, target_params, pred, shift_left(logp, j)[:, :T], wj)
    total = total + weight * (feature_weight * reg + ce_weight * terms["ce"])
    norm = norm + weight
    metrics.update({f"reg_{name}": reg, f"ce_{name}": terms["ce"],
                    f"agree_{name}": terms["agree"]})
  metrics["tokens"] = jnp.sum(w)
  return total / norm, metrics


def train(cfg: EagleTrainConfig, **kw) -> HeadTrainResult:
  """Trains an EAGLE head (`train_head`'s keyword arguments)."""
  recipe = HeadRecipe(
      what="EAGLE head",
      build=lambda target: eagle.EagleHead(eagle.EagleConfig.for_target(target.config,
                                                                         **dict(cfg.head))),
      loss=functools.partial(eagle_loss, unroll=cfg.unroll, unroll_decay=cfg.unroll_decay,
                             ce_weight=cfg.ce_weight, feature_weight=cfg.feature_weight,
                             first_draft_weight=cfg.first_draft_weight),
      describe=lambda m: (f"loss {m['loss']:.4f} reg_1 {m['reg_1']:.4f} agree_1 "
                          f"{m['agree_1']:.3f} agree_{cfg.unroll} "
                          f"{m[f'agree_{cfg.unroll}']:.3f}"
                          + (f" first draft agree_s{cfg.unroll} "
                             f"{m[f'agree_s{cfg.unroll}']:.3f}"
                             if f"agree_s{cfg.unroll}" in m else "")))
  return train_head(cfg, recipe, **kw)
