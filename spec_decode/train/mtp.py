"""Training DeepSeek-V3-style sequential MTP modules on a frozen target.

    python -m spec_decode.cli.train --gin_file=configs/demo/ende_mtp.gin

The frozen target runs teacher-forced on each batch's decoder inputs s_0 ..
s_{T-1} (the task's targets, or the target's own greedy outputs with
prefixes='target'), giving its final decoder states f_t and next-token laws
p_t. The modules run teacher-forced on the same sequence (`MtpModules.forward`:
module k at position t reads h^{k-1}_t and the TRUE token s_{t+k}), and module
k's prediction at t is trained against the target's law of the same token,
p_{t+k} (self-distillation: the drafter should predict what the target will
say, which is also what the verifier accepts):

  loss = sum_k depth_decay^(k-1) KL(p_{t+k} || LM(h^k_t)) / sum_k depth_decay^(k-1)

(KL: the cross-entropy less the target laws' entropy; the same gradients, 0 at a
perfect fit).

DeepSeek-V3 trains the modules jointly with the main model on data labels with
equal weights; here the target is frozen and later depths weigh less (a
drafted chain stops at its first rejection). A recipe on the shared head trainer
(`train.heads.train_head`): runs resume exactly from `workdir`, and the modules are
exported in the one format of draft heads (`checkpoints.heads`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from spec_decode import configurable
from spec_decode.heads import mtp
from spec_decode.train import trainer
from spec_decode.train.heads import (HeadRecipe, HeadTrainConfig, HeadTrainResult, distill_terms,
                                     shift_left, target_features, train_head)


@configurable.register(runnable=True)
@dataclasses.dataclass(frozen=True)
class MtpTrainConfig(HeadTrainConfig):
  """An MTP-module training run (`HeadTrainConfig` plus num_modules D and depth_decay, the
  loss weight ratio of module k + 1 to module k)."""
  num_modules: int = 4
  depth_decay: float = 0.8

  _positive_ints = HeadTrainConfig._positive_ints + ("num_modules",)
  _head_config = mtp.MtpConfig
  _head_settings = {"num_modules": "num_modules"}

  def __post_init__(self):
    super().__post_init__()
    trainer.check_real(self, "depth_decay", "a number in (0, 1]", lambda v: 0 < v <= 1)

  def run(self, **kw) -> HeadTrainResult:
    """Trains MTP modules (`train`): what the command line runs with this config."""
    return train(self, **kw)


def mtp_loss(modules: mtp.MtpModules, params, target, target_params, batch, *,
             depth_decay: float):
  """(loss, metrics) of one batch; see the module doc."""
  dec_in = batch["decoder_inputs"]
  encoded, feats, logp = target_features(target, target_params, batch["encoder_tokens"], dec_in)
  w = batch["weights"]
  states = modules.forward(params, encoded, feats, lambda t: target.embed(target_params, t),
                           dec_in)
  total, norm, metrics = 0.0, 0.0, {}
  for k, h in enumerate(states, start=1):
    terms = distill_terms(target, target_params, h, shift_left(logp, k), shift_left(w, k))
    weight = depth_decay ** (k - 1)
    total, norm = total + weight * terms["kl"], norm + weight
    metrics.update({f"{name}_{k}": v for name, v in terms.items()})
  metrics["tokens"] = jnp.sum(w)
  return total / norm, metrics


def train(cfg: MtpTrainConfig, **kw) -> HeadTrainResult:
  """Trains MTP modules (`train_head`'s keyword arguments)."""
  D = cfg.num_modules
  recipe = HeadRecipe(
      what="MTP modules",
      build=lambda target: mtp.MtpModules(mtp.MtpConfig.for_target(
          target.config, num_modules=D, **dict(cfg.head))),
      loss=functools.partial(mtp_loss, depth_decay=cfg.depth_decay),
      describe=lambda m: (f"loss {m['loss']:.4f} agree_1 {m['agree_1']:.3f} agree_{D} "
                          f"{m[f'agree_{D}']:.3f}"))
  return train_head(cfg, recipe, **kw)
