"""Medusa-style heads (Cai et al. 2024) on a frozen T5 target's final decoder states.

Head k (k = 1 .. K) reads the target's final decoder state h_t (the state the
target's own LM head turns into the law of token t + 1) and predicts token
t + 1 + k through a residual block and the TARGET's LM head (frozen, shared):

  f_k = h_t + SiLU(h_t W_k + b_k),   logits_k = target.logits_from_hidden(f_k).

W_k and b_k start at zero, so every head starts as the target's next-token
prediction (Medusa's initialisation) and learns the offset. The heads cost K
small matmuls and one LM-head product of K rows per proposal, with no
sequential draft calls: a chain of K tokens comes out of one state.

Training: self-distillation on the frozen target (`train.medusa`).

Checkpoints: the one format of draft heads (`checkpoints.heads`, kind 'medusa',
float32 arrays); directories written before it (`medusa.json`, `params.msgpack`) still load.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.models import base, t5


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  """num_heads K (tokens proposed per call at most), the target's emb_dim and vocab_size.
  The heads compute in float32 (`dtype`)."""
  num_heads: int
  emb_dim: int
  vocab_size: int

  def __post_init__(self):
    for name in ("num_heads", "emb_dim", "vocab_size"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"MedusaConfig.{name} must be an int >= 1, got {v!r}")

  @classmethod
  def for_target(cls, target: t5.T5, num_heads: int) -> "MedusaConfig":
    return cls(num_heads=num_heads, emb_dim=target.config.emb_dim,
               vocab_size=target.config.vocab_size)

  @property
  def dtype(self):
    return jnp.dtype(jnp.float32)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d) -> "MedusaConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class MedusaHeads(base.ParamSpecs):
  """K heads over a target's final decoder states (hashable: a jit-static draft "model").

  It is the draft of `decoding.Speculative(drafter=MedusaDrafter())`: the loop
  passes it as `draft` with its params as `draft_params`; it has no encoder or
  cache of its own.
  """
  config: MedusaConfig

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def num_heads(self) -> int:
    return self.config.num_heads

  def _param_specs(self):
    """Zero residual blocks: every head starts as the target's next-token prediction."""
    K, D = self.config.num_heads, self.config.emb_dim
    zeros = jax.nn.initializers.zeros
    return {"w": ((K, D, D), (None, "embed", "mlp"), zeros), "b": ((K, D), (None, "mlp"), zeros)}

  def init(self, rng=None) -> dict:
    """Zero residual blocks (deterministic: rng is unused)."""
    return super().init(jax.random.PRNGKey(0) if rng is None else rng)

  def check_params(self, params) -> None:
    """Raises ValueError unless `params` has these heads' names and shapes."""
    self.check_param_names(params, f"Medusa heads ({self.num_heads})")

  def check_target(self, target) -> None:
    """ValueError unless `target` is a T5 of this head's emb_dim and vocabulary."""
    if not isinstance(target, t5.T5):
      raise ValueError(f"Medusa heads read a T5 target's decoder states; got "
                       f"{type(target).__name__}")
    c = target.config
    if (c.emb_dim, c.vocab_size) != (self.config.emb_dim, self.config.vocab_size):
      raise ValueError(f"Medusa heads were made for emb_dim {self.config.emb_dim}, vocab_size "
                       f"{self.config.vocab_size}; the target has emb_dim {c.emb_dim}, "
                       f"vocab_size {c.vocab_size}")

  def features(self, params, hidden):
    """hidden [..., D] -> the heads' states [..., K, D]."""
    h = hidden.astype(jnp.float32)
    z = jnp.einsum("...d,kde->...ke", h, params["w"]) + params["b"]
    return h[..., None, :] + jax.nn.silu(z)

  def logits(self, params, target: t5.T5, target_params, hidden):
    """hidden [..., D] -> float32 logits [..., K, V] through the target's LM head."""
    f = self.features(params, hidden)
    shape = f.shape
    flat = f.reshape((-1, 1, shape[-1])).astype(target.config.dtype)
    out = target.logits_from_hidden(target_params, flat)
    return out.reshape(shape[:-1] + (out.shape[-1],))


head_checkpoints.register("medusa", MedusaHeads, what="a Medusa heads", dtype=jnp.float32,
                          from_config=lambda d: MedusaHeads(MedusaConfig.from_json(d)))
