"""T5Config from the parameter shapes of a T5X checkpoint.

Read from shapes: vocab_size and emb_dim (token_embedder/embedding [V, E]),
num_heads and relative_attention_num_buckets (encoder/relpos_bias/rel_embedding
[N, buckets]), head_dim (query kernel [E, N * H] / N), mlp_dim, the layer
counts, the MLP kind ('wi' -> ReLU, T5 1.0; 'wi_0', 'wi_1' -> gated GELU,
T5.1.1) and logits_via_embedding (no decoder/logits_dense). Not recorded in
the shapes and left at T5's values: relative_attention_max_distance 128,
layer_norm_epsilon 1e-6.
"""

from __future__ import annotations

import re
from typing import Mapping

from spec_decode.checkpoints.common import CheckpointError
from spec_decode.models import t5


def _shape(shapes, name, rank):
  if name not in shapes:
    raise CheckpointError(f"cannot infer the T5 config: parameter {name} is missing")
  shape = tuple(shapes[name])
  if len(shape) != rank:
    raise CheckpointError(f"cannot infer the T5 config: parameter {name} has shape {shape}, "
                          f"expected rank {rank}")
  return shape


def _num_layers(shapes, stack: str) -> int:
  found = {int(m.group(1)) for k in shapes if (m := re.match(rf"{stack}/layers_(\d+)/", k))}
  if not found:
    raise CheckpointError(f"cannot infer the T5 config: no {stack}/layers_<i> parameters")
  return max(found) + 1


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], dtype=None) -> t5.T5Config:
  """The T5Config whose parameters have these {path: shape}; check with check_shapes."""
  vocab, emb = _shape(shapes, "token_embedder/embedding", 2)
  heads, buckets = _shape(shapes, "encoder/relpos_bias/rel_embedding", 2)
  joined = _shape(shapes, "encoder/layers_0/attention/query/kernel", 2)[1]
  if joined % heads:
    raise CheckpointError(f"cannot infer the T5 config: query width {joined} is not a "
                          f"multiple of the {heads} heads of the relative position table")
  mlp = "encoder/layers_0/mlp"
  if f"{mlp}/wi/kernel" in shapes:
    activations, mlp_dim = ("relu",), _shape(shapes, f"{mlp}/wi/kernel", 2)[1]
  elif f"{mlp}/wi_0/kernel" in shapes:
    activations, mlp_dim = ("gelu", "linear"), _shape(shapes, f"{mlp}/wi_0/kernel", 2)[1]
  else:
    raise CheckpointError(f"cannot infer the T5 config: neither {mlp}/wi/kernel nor "
                          f"{mlp}/wi_0/kernel is present")
  try:
    return t5.T5Config(
        vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=joined // heads,
        num_encoder_layers=_num_layers(shapes, "encoder"),
        num_decoder_layers=_num_layers(shapes, "decoder"), mlp_dim=mlp_dim,
        mlp_activations=activations,
        logits_via_embedding="decoder/logits_dense/kernel" not in shapes,
        relative_attention_num_buckets=buckets,
        **({} if dtype is None else {"dtype": dtype}))
  except ValueError as e:
    raise CheckpointError(f"cannot infer the T5 config from the parameter shapes: {e}") from e
