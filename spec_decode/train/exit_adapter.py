"""Training an exit adapter (Kangaroo) on a frozen target, for self-speculation.

    python -m spec_decode.cli.train --gin_file=configs/demo/ende_exit_adapter.gin

The frozen target is run teacher-forced on each batch's decoder inputs, giving its encoder
output and its next-token laws p. The draft (`ExitAdapter.draft`: the target's first k
decoder layers, then the adapter, one T5 decoder block of the target's layer shape, then the
target's frozen final norm and LM head) decodes the same inputs on that encoder output; the
adapter's block reads the stream l after target layer k - 1 (its first k layers are the
target's, recomputed: 1/L of the target's decoder, no gradient reaches them):

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
  _head_config = exit_adapter.ExitAdapterConfig
  _head_settings = {"layers": "layers"}

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.init_from_target, bool):
      raise ValueError(f"ExitAdapterTrainConfig.init_from_target must be True or False, got "
                       f"{self.init_from_target!r}")

  def run(self, **kw) -> HeadTrainResult:
    """Trains an exit adapter (`train`): what the command line runs with this config."""
    return train(self, **kw)


def adapted_states(adapter: exit_adapter.ExitAdapter, params, target: t5.T5, target_params,
                   encoded: t5.EncoderOutput, decoder_inputs):
  """The draft's final-normed states [B, T, D], teacher-forced from an empty cache on the
  target's encoder output: the draft model itself (`ExitAdapter.draft`, the target's first
  layers and the adapter) decoding, so training computes what drafting computes."""
  draft, dp = adapter.draft(target), adapter.draft_params(target_params, params)
  cache = draft.init_cache(dp, encoded, decoder_inputs.shape[1])
  return draft.decode(dp, cache, decoder_inputs).hidden


def loss_fn(adapter: exit_adapter.ExitAdapter, params, target: t5.T5, target_params, batch):
  """(loss, metrics) of one teacher-forced batch (module doc): KL to the target's laws."""
  encoded, _, logp = target_features(target, target_params, batch["encoder_tokens"],
                                     batch["decoder_inputs"])
  states = adapted_states(adapter, params, target, target_params, encoded,
                          batch["decoder_inputs"])
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
