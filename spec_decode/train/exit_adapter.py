"""Training an exit adapter (Kangaroo) on a frozen target, for self-speculation.

    python -m spec_decode.cli.train --gin_file=configs/demo/ende_exit_adapter.gin

The frozen target is run teacher-forced on each batch's decoder inputs, giving the residual
stream l after its decoder layer k - 1 and its next-token laws p. The adapter (one T5
decoder block of the target's layer shape, `heads.exit_adapter`) runs on l, causal over the
sequence and cross-attending to the target's encoder output, with the target's relative-
position bias; the target's frozen final norm and LM head read its output:

  loss = KL(p || softmax(LM(final_norm(adapter(l)))))     (weighted mean over real tokens)

which is what the drafter computes at decode time (the same layers, the same bias), so the
agreement reported is the chain's greedy acceptance at each position. The adapter starts
as a copy of the target's layer k (`init_from_target`; the draft then reads as the
target's first k + 1 layers do) or from a random block.

A recipe on the shared head trainer (`train.heads.train_head`): resumable from `workdir`,
exported in the one format of draft heads (`checkpoints.heads`, kind 'exit_adapter').
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spec_decode import configurable
from spec_decode.heads import exit_adapter
from spec_decode.models import t5
from spec_decode.train.heads import (HeadRecipe, HeadTrainConfig, HeadTrainResult, distill_terms,
                                     target_features, train_head)


@configurable.register(runnable=True)
@dataclasses.dataclass(frozen=True)
class ExitAdapterTrainConfig(HeadTrainConfig):
  """An exit-adapter training run (`HeadTrainConfig` plus layers k, the target decoder
  layers the adapter reads after, and init_from_target: start from the target's layer k)."""
  layers: int = 2
  init_from_target: bool = True
  learning_rate: float = 1e-3

  _positive_ints = HeadTrainConfig._positive_ints + ("layers",)

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.init_from_target, bool):
      raise ValueError(f"ExitAdapterTrainConfig.init_from_target must be True or False, got "
                       f"{self.init_from_target!r}")

  def run(self, **kw) -> HeadTrainResult:
    """Trains an exit adapter (`train`): what the command line runs with this config."""
    return train(self, **kw)


def adapted_states(adapter: exit_adapter.ExitAdapter, params, target: t5.T5, target_params,
                   encoded: t5.EncoderOutput, stream_BTD):
  """The adapter's final-normed states [B, T, D] on the target's layer-k stream, teacher-
  forced from an empty cache (what the draft's layer k and final norm compute)."""
  c = target.config
  B, T, _ = stream_BTD.shape
  dec = target_params["decoder"]
  bias, mask = target.self_attention_geometry(dec["relpos_bias"]["rel_embedding"],
                                              jnp.zeros((B,), jnp.int32), T, T)
  empty_k, empty_v = t5.empty_self_kv(c, B, T)
  cross_k, cross_v = target.cross_kv(params["layers_0"], encoded.hidden)
  cross_mask = jnp.broadcast_to(encoded.mask[:, None, :], (B, T, encoded.mask.shape[1]))
  x, _, _ = target.decoder_layer(params["layers_0"], stream_BTD.astype(c.dtype), empty_k,
                                 empty_v, jnp.zeros((B,), jnp.int32), bias, mask, cross_k,
                                 cross_v, cross_mask)
  return t5._rms_norm(x, dec["decoder_norm"]["scale"], c.layer_norm_epsilon)


def loss_fn(adapter: exit_adapter.ExitAdapter, params, target: t5.T5, target_params, batch):
  """(loss, metrics) of one teacher-forced batch (module doc): KL to the target's laws."""
  D = target.config.emb_dim
  encoded, hidden, logp = target_features(target, target_params, batch["encoder_tokens"],
                                          batch["decoder_inputs"], (adapter.layers - 1,))
  states = adapted_states(adapter, params, target, target_params, encoded, hidden[..., D:])
  terms = distill_terms(target, target_params, states, logp, batch["weights"])
  metrics = dict(terms, loss=terms["kl"], tokens=jnp.sum(batch["weights"]))
  return terms["kl"], metrics


def train(cfg: ExitAdapterTrainConfig, **kw) -> HeadTrainResult:
  """Trains an exit adapter (`train_head`'s keyword arguments)."""
  def init(adapter, rng, target, target_params):
    if cfg.init_from_target:
      return adapter.from_target_layer(target_params, adapter.layers)
    return adapter.init(rng)

  recipe = HeadRecipe(
      what="exit adapter",
      build=lambda target: exit_adapter.ExitAdapter(exit_adapter.ExitAdapterConfig.for_target(
          target.config, cfg.layers, **dict(cfg.head))),
      loss=loss_fn, init=init,
      describe=lambda m: f"loss {m['loss']:.4f} agree {m['agree']:.3f}")
  return train_head(cfg, recipe, **kw)
