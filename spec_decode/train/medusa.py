"""Training Medusa heads (`heads.medusa`) by self-distillation on a frozen target.

    python -m spec_decode.cli.train --gin_file=configs/demo/ende_medusa.gin

The target decodes the training inputs greedily (prefixes='target': its own outputs
are what the heads see when decoding); then, teacher-forced on those outputs, head k
at position t is trained with cross-entropy against the target's own law at position
t + k, softmax(target logits at t + k), weighted 0.8^(k - 1) (later heads are harder
and matter less: a chain stops at its first rejection). A recipe on the shared head
trainer (`train.heads.train_head`): runs resume exactly from `workdir`, and the heads
are exported in the one format of draft heads (`checkpoints.heads`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_decode import configurable
from spec_decode.heads import medusa
from spec_decode.models import t5
from spec_decode.train.heads import (HeadRecipe, HeadTrainConfig, HeadTrainResult, target_features,
                                     train_head)

HEAD_DECAY = 0.8


@configurable.register(runnable=True)
@dataclasses.dataclass(frozen=True)
class MedusaTrainConfig(HeadTrainConfig):
  """A Medusa-heads training run (`HeadTrainConfig` plus num_heads K); by default on the
  target's own greedy outputs (prefixes='target'), AdamW with a cosine schedule."""
  num_heads: int = 4
  prefixes: str = "target"
  teacher_examples: int = 2048
  learning_rate: float = 3e-3
  warmup_steps: int = 0
  num_steps: int = 300
  target_length: int = 48
  log_every: int = 50

  _positive_ints = HeadTrainConfig._positive_ints + ("num_heads",)
  # MedusaConfig.for_target takes no overrides: its sizes are the target's and num_heads
  _head_config = medusa.MedusaConfig
  _head_settings = {"num_heads": "num_heads"}
  _head_fixed = ("emb_dim", "vocab_size")

  def run(self, **kw) -> HeadTrainResult:
    """Trains Medusa heads (`train`): what the command line runs with this config."""
    return train(self, **kw)


def loss_fn(heads: medusa.MedusaHeads, params, target: t5.T5, target_params, batch):
  """(loss, metrics) of self-distillation on one teacher-forced batch.

  batch: encoder_tokens [B, S], decoder_inputs [B, T] (BOS first), weights
  [B, T] (1 at real target tokens). Head k at position t is scored against
  the target's law at t + k for every t with a real token at t + k.
  """
  _, hidden, teacher = target_features(target, target_params, batch["encoder_tokens"],
                                       batch["decoder_inputs"])  # teacher: log p [B, T, V]
  T = batch["decoder_inputs"].shape[1]
  logits = heads.logits(params, target, target_params, hidden)  # [B, T, K, V]
  logq = jax.nn.log_softmax(logits, axis=-1)
  total, weight_sum, metrics = 0.0, 0.0, {}
  for k in range(1, heads.num_heads + 1):
    p_next = jnp.exp(teacher[:, k:])  # the target's law at t + k, for t = 0 .. T - k - 1
    ce = -jnp.sum(p_next * logq[:, :T - k, k - 1], axis=-1)  # [B, T - k]
    w = batch["weights"][:, k:]
    ce_k = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
    agree = jnp.argmax(logq[:, :T - k, k - 1], -1) == jnp.argmax(teacher[:, k:], -1)
    metrics[f"head{k}_agreement"] = jnp.sum(agree * w) / jnp.maximum(jnp.sum(w), 1.0)
    metrics[f"head{k}_ce"] = ce_k
    total = total + HEAD_DECAY ** (k - 1) * ce_k
    weight_sum += HEAD_DECAY ** (k - 1)
  loss = total / weight_sum
  metrics["loss"] = loss
  metrics["tokens"] = jnp.sum(batch["weights"])  # evaluations weight batches by it
  return loss, metrics


def train(cfg: MedusaTrainConfig, **kw) -> HeadTrainResult:
  """Trains Medusa heads (`train_head`'s keyword arguments)."""
  recipe = HeadRecipe(
      what="Medusa heads",
      build=lambda target: medusa.MedusaHeads(medusa.MedusaConfig.for_target(
          target, cfg.num_heads)),
      loss=loss_fn,
      describe=lambda m: (f"loss {m['loss']:.4f} head1_agreement "
                          f"{m['head1_agreement']:.3f}"))
  return train_head(cfg, recipe, **kw)
