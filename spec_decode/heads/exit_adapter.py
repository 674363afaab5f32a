"""An exit adapter (Kangaroo, Liu et al. 2024) for self-speculation on a T5 target.

Self-speculation drafts with the target's own first k decoder layers, its final norm and
its LM head (`decoding.drafters.layer_skip`). A target trained only at its last layer
reads poorly from layer k (the demo EnDe target: alpha 0.30 at k = 2), so Kangaroo trains a
small adapter between the shallow sub-network and the LM head, on the frozen target:

  l_t   = the residual stream after target decoder layer k - 1   (shared with the target)
  y_t   = one T5 decoder block on l_t                            (the adapter: self-attention
                                                                  over its own cache, cross-
                                                                  attention to the target's
                                                                  encoder output, MLP)
  draft logits = LM_head(final_norm(y_t))                        (the target's, frozen)

Decoding, the draft is literally a T5 of k + 1 decoder layers: the target's layers
0 .. k - 1, then the adapter as layer k, with the target's relative-position bias, final
norm and LM head; so the drafter runs the draft model's loop and cache unchanged. Trained by
`train.exit_adapter` (KL to the target's law through its frozen LM head).

Parameters: layers_0/... with the names of a T5 decoder layer (`t5.T5.decoder_layer`, not a
copy); config: the target layer's shape and `layers` = k. The adapter's block has the
target layer's shape, so it costs one more target layer per draft step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.decoding.drafters.layer_skip import truncated, truncated_params
from spec_decode.heads.eagle import check_feature_target
from spec_decode.models import base, t5

_SHAPE_FIELDS = ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim", "mlp_activations",
                 "layer_norm_epsilon")


@dataclasses.dataclass(frozen=True)
class ExitAdapterConfig:
  """layers: k, the target decoder layers the adapter reads after (1 .. L - 1); the rest
  must equal the target's (`for_target`), since the adapter is one more layer of its shape."""
  layers: int
  vocab_size: int
  emb_dim: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  mlp_activations: tuple[str, ...] = ("gelu", "linear")
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers < 1:
      raise ValueError(f"ExitAdapterConfig.layers must be an int >= 1, got {self.layers!r}")

  @classmethod
  def for_target(cls, target_config: t5.T5Config, layers: int, **overrides) -> "ExitAdapterConfig":
    """An adapter after this target's first `layers` decoder layers, of its layers' shape."""
    fields = {f: getattr(target_config, f) for f in _SHAPE_FIELDS}
    return cls(layers=layers, **{**fields, "dtype": target_config.dtype, **overrides})

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["dtype"] = jnp.dtype(self.dtype).name
    d["mlp_activations"] = list(self.mlp_activations)
    return d

  @classmethod
  def from_json(cls, d) -> "ExitAdapterConfig":
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class ExitAdapter(base.ParamSpecs):
  """The adapter: its parameters and how they join the target's (hashable, jit-static)."""
  config: ExitAdapterConfig

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def layers(self) -> int:
    return self.config.layers

  @property
  def _block(self) -> t5.T5:
    c = self.config
    return t5.T5(t5.T5Config(
        vocab_size=c.vocab_size, emb_dim=c.emb_dim, num_heads=c.num_heads, head_dim=c.head_dim,
        mlp_dim=c.mlp_dim, mlp_activations=c.mlp_activations, num_encoder_layers=1,
        num_decoder_layers=1, layer_norm_epsilon=c.layer_norm_epsilon, dtype=c.dtype))

  def _param_specs(self):
    return {path[len("decoder/"):]: spec for path, spec in self._block._param_specs().items()
            if path.startswith("decoder/layers_0/")}

  def check_params(self, params) -> None:
    """Raises ValueError unless `params` has this adapter's names and shapes."""
    self.check_param_names(params, "exit adapter")

  def check_target(self, target) -> None:
    """Raises ValueError unless the adapter fits after `layers` of this target's layers."""
    check_feature_target(target, self.config.emb_dim, self.vocab_size, "an exit adapter")
    tc = target.config
    differ = [f for f in _SHAPE_FIELDS if getattr(tc, f) != getattr(self.config, f)]
    if differ:
      raise ValueError(f"an exit adapter has the target decoder layers' shape; its "
                       f"{', '.join(differ)} differ from the target's")
    if self.layers >= tc.num_decoder_layers:
      raise ValueError(f"an exit adapter after {self.layers} decoder layers needs a target with "
                       f"more than {self.layers}, got {tc.num_decoder_layers}")

  def from_target_layer(self, target_params, layer: int) -> dict:
    """Adapter params copied from the target's decoder layer `layer` (a training start
    that drafts as the target's first layers + 1 do); copies, not the target's own buffers
    (a train state donates its params to each step)."""
    layer_params = target_params["decoder"][f"layers_{layer}"]
    return {"layers_0": jax.tree_util.tree_map(
        lambda x: jnp.array(x, dtype=self.config.dtype, copy=True), layer_params)}

  def decode_params(self, params) -> dict:
    """`params` laid out as the target's own layers are for decoding (`T5.decode_params`:
    packed for the CPU kernel where the target's are)."""
    laid = self._block.decode_params({"decoder": dict(params)})
    return dict(laid["decoder"])

  # ------------------------------------------------------------------ the draft model
  def draft(self, target: t5.T5) -> t5.T5:
    """The draft: a T5 of the target's settings with layers + 1 decoder layers."""
    return truncated(target, self.layers + 1)

  def draft_params(self, target_params, params) -> dict:
    """The draft's parameters: the target's (the same leaves, no copy) without decoder layers
    `layers` .., the adapter as decoder layer `layers`."""
    shallow = truncated_params(target_params, self.layers)
    return {**shallow, "decoder": {**shallow["decoder"],
                                   f"layers_{self.layers}": params["layers_0"]}}


head_checkpoints.register("exit_adapter", ExitAdapter, what="an exit adapter",
                          from_config=lambda d: ExitAdapter(ExitAdapterConfig.from_json(d)))
