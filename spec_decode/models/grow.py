"""Function-preserving growth of a trained T5 into a wider and deeper one (Net2Net-style).

    big_params = grow.grow(small_cfg, small_params, big_cfg, jax.random.PRNGKey(0))

The grown model computes the small model's function (up to the RMS norms'
epsilon, see below) while every new parameter can still learn, so training
continues from the small model's quality instead of from scratch (Chen et al.,
"Net2Net", 2016; Gong et al., "Efficient training of BERT by progressively
stacking", 2019). It is how the project gets a demo target large enough for its
weights, not its kernel launches, to dominate a decoding step on a CPU, without
days of training (`configs/demo/ende_target_big.gin`).

The residual stream keeps the small model's D_s dimensions first; the new
D_l - D_s dimensions start at zero and stay zero until training moves them:
  * the token embedding's new columns are zero;
  * every kernel that writes the residual stream (attention `out`, MLP `wo`)
    is zero outside its original block, so new heads, new MLP units and new
    layers add nothing at first; their gradients are not zero (the kernels
    that read the stream are random in their new rows and columns), so they
    train;
  * the RMS norms average over D_l dimensions of which only D_s are non-zero,
    so their original scales are multiplied by sqrt(D_s / D_l) (the result
    differs from the small model's only in that the epsilon acts as
    eps * D_l / D_s);
  * new heads keep the head size, get the fresh model's relative-position
    rows; the small model's heads and MLP units come first;
  * the small model's layers keep their order, spread over the grown stack
    (layer i at position i * L_l // L_s); the other layers are new and start as
    identity maps (pre-norm residual blocks with zero output kernels).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np

from spec_decode.models import t5

# Kernels that write the residual stream: zero outside the block they take over.
_WRITERS = ("out", "wo")


def _check(small: t5.T5Config, big: t5.T5Config) -> None:
  same = ("vocab_size", "head_dim", "mlp_activations", "logits_via_embedding",
          "relative_attention_num_buckets", "relative_attention_max_distance")
  differ = [f"{f}: {getattr(small, f)!r} vs {getattr(big, f)!r}" for f in same
            if getattr(small, f) != getattr(big, f)]
  if differ:
    raise ValueError("grow needs the same vocabulary, head size, activations, LM head and "
                     "relative-position buckets; these differ (small vs big): "
                     + "; ".join(differ))
  if small.logits_via_embedding:
    raise ValueError("grow supports T5.1.1 models (separate logits_dense LM head); a tied "
                     "embedding LM head scales logits by 1/sqrt(emb_dim), which growing "
                     "emb_dim would change")
  smaller = [f"{f}: {getattr(small, f)} > {getattr(big, f)}" for f in
             ("emb_dim", "num_heads", "mlp_dim", "num_encoder_layers", "num_decoder_layers")
             if getattr(small, f) > getattr(big, f)]
  if smaller:
    raise ValueError("grow can only enlarge a model; the target shape is smaller in "
                     + "; ".join(smaller))


def layer_map(num_small: int, num_big: int) -> dict[int, int]:
  """{big layer index: small layer index} for the layers the small model's fill."""
  return {i * num_big // num_small: i for i in range(num_small)}


def _paste(fresh: np.ndarray, old: np.ndarray, *, zero_rest: bool) -> np.ndarray:
  """`old` in the leading corner of `fresh` (zeros elsewhere when zero_rest)."""
  out = np.zeros_like(fresh) if zero_rest else np.array(fresh, copy=True)
  out[tuple(slice(0, n) for n in old.shape)] = old
  return out


def grow(small_config: t5.T5Config, small_params: Mapping[str, Any], big_config: t5.T5Config,
         rng: jax.Array) -> dict[str, Any]:
  """Parameters of `big_config` computing the small model's function (see module docstring).

  New entries come from `t5.T5(big_config).init(rng)`; returned arrays are numpy,
  in big_config.dtype.
  """
  _check(small_config, big_config)
  fresh = jax.tree_util.tree_map(np.asarray, jax.device_get(t5.T5(big_config).init(rng)))
  small = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32),
                                 jax.device_get(small_params))
  norm_factor = math.sqrt(small_config.emb_dim / big_config.emb_dim)

  def grow_layer(big_layer: dict, small_layer: dict | None) -> dict:
    out = {}
    for name, sub in big_layer.items():
      if name.endswith("layer_norm"):
        scale = np.array(sub["scale"], copy=True)
        if small_layer is not None:
          old = small_layer[name]["scale"] * norm_factor
          scale[:old.shape[0]] = old
        out[name] = {"scale": scale}
        continue
      out[name] = {}
      for kname, kernel in sub.items():  # attention query/key/value/out, mlp wi*/wo
        w = kernel["kernel"]
        writer = kname in _WRITERS
        if small_layer is None:
          new = np.zeros_like(w) if writer else np.array(w, copy=True)
        else:
          new = _paste(w, small_layer[name][kname]["kernel"], zero_rest=writer)
        out[name][kname] = {"kernel": new}
    return out

  def grow_stack(side: str, num_small: int, num_big: int, final_norm: str) -> dict:
    big_side, small_side = fresh[side], small[side]
    mapping = layer_map(num_small, num_big)
    out = {}
    for i in range(num_big):
      old = small_side[f"layers_{mapping[i]}"] if i in mapping else None
      out[f"layers_{i}"] = grow_layer(big_side[f"layers_{i}"], old)
    scale = np.array(big_side[final_norm]["scale"], copy=True)
    scale[:small_config.emb_dim] = small_side[final_norm]["scale"] * norm_factor
    out[final_norm] = {"scale": scale}
    out["relpos_bias"] = {"rel_embedding": _paste(big_side["relpos_bias"]["rel_embedding"],
                                                  small_side["relpos_bias"]["rel_embedding"],
                                                  zero_rest=False)}
    return out

  grown = {
      "token_embedder": {"embedding": _paste(fresh["token_embedder"]["embedding"],
                                             small["token_embedder"]["embedding"],
                                             zero_rest=True)},
      "encoder": grow_stack("encoder", small_config.num_encoder_layers,
                            big_config.num_encoder_layers, "encoder_norm"),
      "decoder": grow_stack("decoder", small_config.num_decoder_layers,
                            big_config.num_decoder_layers, "decoder_norm"),
  }
  grown["decoder"]["logits_dense"] = {"kernel": _paste(
      fresh["decoder"]["logits_dense"]["kernel"], small["decoder"]["logits_dense"]["kernel"],
      zero_rest=False)}
  dtype = big_config.dtype
  return jax.tree_util.tree_map(lambda x: np.asarray(x).astype(dtype), grown)
