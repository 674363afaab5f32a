"""An EAGLE head (Li et al. 2024) for an encoder-decoder target.

The head predicts the target's next final decoder state from the one it has:
with f_t the target's final decoder state at input s_t (the state its logits
for s_{t+1} are read from) and e_{t+1} the target's embedding of the token
s_{t+1} chosen after it,

  x_t   = W [norm(f_t); norm(e_{t+1})]             (2D -> D)
  y_t   = one T5 decoder block on x_t              (self-attention over the head's
                                                    own cache, cross-attention to
                                                    the TARGET's encoder output, MLP)
  f'_{t+1} = final_norm(y_t)                       the predicted f_{t+1}

and the target's own frozen LM head turns f'_{t+1} into logits for s_{t+2}.
Drafting feeds the head its own predictions f' in place of f
(`decoding.drafters.eagle`); checkpoints are the one format of draft heads
(`checkpoints.heads`, kind 'eagle').

Head cache entry t holds the pair (f_t, s_{t+1}) at position t, so a head
cache of length m has consumed the pairs of s_0 .. s_{m-1}: the same length
as the target cache at the top of a speculative iteration.

EAGLE-3's multi-layer feature fusion (`EagleConfig.fuse_layers`): where the target
computed the state, the head is fed W_fuse [f_t; norm(l_t^i) for the listed layers i]
(l^i: the residual stream after target decoder layer i, low and middle layers beside
the final state) instead of f_t; its own predictions stay D-wide, so drafting feeds
them as before. The verify call returns those streams when the drafter asks
(`Drafter.target_layers`), so fusion costs no second target pass either.

A learned start (`EagleConfig.start_feature`): the target's state f_0 at s_0 = BOS is a
function of the encoder output alone, so the head can predict it before the target ran
at all: from the pair (a learned vector, e(s_0)) in an otherwise empty cache
(`start_prediction`). A row's first iteration then drafts gamma tokens, as a draft model's
does, instead of spending a target call on s_1 alone.

Parameters (T5X-style names): fc/kernel [2D, D]; feature_norm, token_norm,
final_norm scales [D]; relpos_bias/rel_embedding; layers_0/... with the names
of a T5 decoder layer; with fuse_layers also fuse/kernel [(1 + L) D, D] and
fuse_norm_<i>/scale [D]; with start_feature also start/feature [D]. The block is
`t5.T5.decoder_layer`, not a copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.models import base, t5


@dataclasses.dataclass(frozen=True)
class EagleConfig:
  """vocab_size and d_model must equal the target's (vocab_size, emb_dim)."""
  vocab_size: int
  d_model: int
  num_heads: int = 4
  head_dim: int = 32
  mlp_dim: int = 512
  mlp_activations: tuple[str, ...] = ("gelu", "linear")
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32
  fuse_layers: tuple[int, ...] = ()
  start_feature: bool = False

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    object.__setattr__(self, "fuse_layers", tuple(self.fuse_layers))
    if not isinstance(self.start_feature, bool):
      raise ValueError(f"EagleConfig.start_feature must be a bool, got {self.start_feature!r}")
    bad = [i for i in self.fuse_layers if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad or len(set(self.fuse_layers)) != len(self.fuse_layers):
      raise ValueError(f"EagleConfig.fuse_layers must be distinct decoder layer indices >= 0, "
                       f"got {self.fuse_layers!r}")
    self.block_config  # validates the shared fields

  @classmethod
  def for_target(cls, target_config: t5.T5Config, **overrides) -> "EagleConfig":
    """A head for this target: its vocabulary, width and one layer's shape by default."""
    c = target_config
    fields = dict(vocab_size=c.vocab_size, d_model=c.emb_dim, num_heads=c.num_heads,
                  head_dim=c.head_dim, mlp_dim=c.mlp_dim, mlp_activations=c.mlp_activations,
                  relative_attention_num_buckets=c.relative_attention_num_buckets,
                  relative_attention_max_distance=c.relative_attention_max_distance,
                  layer_norm_epsilon=c.layer_norm_epsilon, dtype=c.dtype)
    return cls(**{**fields, **overrides})

  @property
  def block_config(self) -> t5.T5Config:
    """The T5 whose single decoder layer is the head's block."""
    return t5.T5Config(
        vocab_size=self.vocab_size, emb_dim=self.d_model, num_heads=self.num_heads,
        num_encoder_layers=1, num_decoder_layers=1, head_dim=self.head_dim,
        mlp_dim=self.mlp_dim, mlp_activations=self.mlp_activations, dtype=self.dtype,
        relative_attention_num_buckets=self.relative_attention_num_buckets,
        relative_attention_max_distance=self.relative_attention_max_distance,
        layer_norm_epsilon=self.layer_norm_epsilon)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["dtype"] = jnp.dtype(self.dtype).name
    d["mlp_activations"] = list(self.mlp_activations)
    d["fuse_layers"] = list(self.fuse_layers)
    if not self.fuse_layers:
      del d["fuse_layers"]  # an EAGLE-1 head's file reads as before
    if not self.start_feature:
      del d["start_feature"]  # likewise a head without a learned start
    return d

  @classmethod
  def from_json(cls, d) -> "EagleConfig":
    return cls(**d)


def check_feature_target(target, d_model: int, vocab_size: int, what: str) -> None:
  """Raises ValueError unless `target` is a T5 of this width and vocabulary (`what`, a head
  reading its decoder states, embeddings and LM head, names itself in the message)."""
  if not isinstance(target, t5.T5):
    raise ValueError(f"{what} needs a T5 target (it reads its decoder features, embeddings "
                     f"and LM head), got {type(target).__name__}")
  tc = target.config
  if (tc.emb_dim, tc.vocab_size) != (d_model, vocab_size):
    raise ValueError(f"{what} (d_model {d_model}, vocab_size {vocab_size}) does not match the "
                     f"target (emb_dim {tc.emb_dim}, vocab_size {tc.vocab_size})")


@dataclasses.dataclass(frozen=True)
class EagleHead(base.ParamSpecs):
  """The head: pure functions of (params, inputs); hashable, so jit-static."""
  config: EagleConfig

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def d_model(self) -> int:
    return self.config.d_model

  @property
  def block(self) -> t5.T5:
    return t5.T5(self.config.block_config)

  # ------------------------------------------------------------------ params
  def _param_specs(self):
    c = self.config
    D = c.d_model
    init = jax.nn.initializers
    specs = {}
    for path, spec in self.block._param_specs().items():  # the T5 layer's own initializers
      if path.startswith(("decoder/layers_0/", "decoder/relpos_bias/")):
        specs[path[len("decoder/"):]] = spec
    specs["fc/kernel"] = ((2 * D, D), ("mlp", "embed"),
                          init.variance_scaling(1.0, "fan_in", "normal"))
    for name in ("feature_norm", "token_norm", "final_norm"):
      specs[f"{name}/scale"] = ((D,), ("embed",), init.ones)
    if c.fuse_layers:  # EAGLE-3: the final state and the listed layers' streams fused
      specs["fuse/kernel"] = (((1 + len(c.fuse_layers)) * D, D), ("mlp", "embed"),
                              init.variance_scaling(1.0, "fan_in", "normal"))
      for i in c.fuse_layers:
        specs[f"fuse_norm_{i}/scale"] = ((D,), ("embed",), init.ones)
    if c.start_feature:  # unit scale, as the features feature_norm sees
      specs["start/feature"] = ((D,), ("embed",), init.normal(1.0))
    return specs

  @property
  def has_start(self) -> bool:
    """Whether the head predicts f_0 from its learned start (`start_prediction`)."""
    return self.config.start_feature

  @property
  def target_layers(self) -> tuple[int, ...]:
    """Target decoder layers whose residual streams the head reads beside the final state."""
    return self.config.fuse_layers

  def target_input(self, params, hidden_BTF):
    """The feature the head is fed where the target computed one: the target's final
    state [B, T, D] (EAGLE-1), or with `fuse_layers` (EAGLE-3's multi-layer fusion) the
    projection W_fuse [f; norm(l_i) ...] of the final state f and the residual streams l_i
    after those layers, given as hidden [B, T, D * (1 + len(fuse_layers))]
    (`Committed.target_hidden` of a drafter asking for `target_layers`)."""
    c = self.config
    if not c.fuse_layers:
      return hidden_BTF
    D = c.d_model
    if hidden_BTF.shape[-1] != D * (1 + len(c.fuse_layers)):
      raise ValueError(f"an EAGLE-3 head fusing layers {c.fuse_layers} needs features of "
                       f"{D * (1 + len(c.fuse_layers))}, got {hidden_BTF.shape[-1]}")
    parts = [hidden_BTF[..., :D].astype(c.dtype)]
    for j, i in enumerate(c.fuse_layers, start=1):
      parts.append(t5._rms_norm(hidden_BTF[..., j * D:(j + 1) * D].astype(c.dtype),
                                params[f"fuse_norm_{i}"]["scale"], c.layer_norm_epsilon))
    return self.block._dense(jnp.concatenate(parts, axis=-1), params["fuse"]["kernel"])

  def check_params(self, params) -> None:
    """Raises ValueError unless `params` has this head's names and shapes."""
    self.check_param_names(params, "EAGLE head")

  def check_target(self, target) -> None:
    """Raises ValueError unless `target` is a T5 whose features this head reads."""
    check_feature_target(target, self.d_model, self.vocab_size, "an EAGLE head")
    layers = target.config.num_decoder_layers
    if any(i >= layers for i in self.config.fuse_layers):
      raise ValueError(f"an EAGLE-3 head fusing layers {self.config.fuse_layers} needs a target "
                       f"with more than {max(self.config.fuse_layers)} decoder layers, got "
                       f"{layers}")

  def decode_params(self, params) -> dict:
    """`params` laid out for decoding as a target's are (`T5.decode_params` of the head's
    block: on XLA:CPU with float32 heads, the layer's, fc's and fuse's kernels packed for
    the CPU decoding kernel, in bfloat16 when the head was stored in bfloat16); the same
    values. The drafter's every step then reads the head's weights as the verify call reads
    the target's, at half the bytes of XLA's float32 dots."""
    return dict(self.block.decode_params({"decoder": dict(params)})["decoder"])

  # ------------------------------------------------------------------ running
  def init_cache(self, params, encoded: t5.EncoderOutput, max_decode_len: int) -> t5.DecodeCache:
    """An empty head cache of `max_decode_len` slots, cross-attending to the TARGET's
    encoder output `encoded`."""
    c = self.config
    B = encoded.hidden.shape[0]
    k, v = self.block.cross_kv(params["layers_0"], encoded.hidden.astype(c.dtype),
                               mask=encoded.mask)
    empty_k, empty_v = t5.empty_self_kv(c.block_config, B, max_decode_len)
    return t5.DecodeCache(self_k=(empty_k,), self_v=(empty_v,), cross_k=(k,), cross_v=(v,),
                          encoder_mask=encoded.mask, lengths=jnp.zeros((B,), jnp.int32))

  def step(self, params, cache: t5.DecodeCache, features_BTD, embeddings_BTD, *,
           positions=None, tree_mask=None):
    """Appends T pairs (f_t, e_{t+1}) at each row's cache length.

    features [B, T, D]: target final decoder states (or the head's predictions);
    embeddings [B, T, D]: the target's embeddings of the tokens chosen after them.
    positions [B, T] / tree_mask [B, T, T]: a tree of pairs, as in `T5.decode` (each
    pair at its own position, seeing the cache and its ancestors).
    Returns (predicted next features [B, T, D], cache with lengths + T).
    """
    c = self.config
    block = self.block
    B, T, _ = features_BTD.shape
    f = t5._rms_norm(features_BTD.astype(c.dtype), params["feature_norm"]["scale"],
                     c.layer_norm_epsilon)
    e = t5._rms_norm(embeddings_BTD.astype(c.dtype), params["token_norm"]["scale"],
                     c.layer_norm_epsilon)
    x = block._dense(jnp.concatenate([f, e], axis=-1), params["fc"]["kernel"])
    offsets = cache.lengths
    bias, mask = block.self_attention_geometry(params["relpos_bias"]["rel_embedding"], offsets,
                                               T, cache.max_length, positions, tree_mask)
    cross_mask = jnp.broadcast_to(cache.encoder_mask[:, None, :],
                                  (B, T, cache.encoder_mask.shape[1]))
    x, k, v = block.decoder_layer(params["layers_0"], x, cache.self_k[0], cache.self_v[0],
                                  offsets, bias, mask, cache.cross_k[0], cache.cross_v[0],
                                  cross_mask)
    x = t5._rms_norm(x, params["final_norm"]["scale"], c.layer_norm_epsilon)
    return x, cache.replace(self_k=(k,), self_v=(v,), lengths=offsets + T)

  def start_prediction(self, params, cache: t5.DecodeCache, embeddings_B1D):
    """The predicted f_0 [B, D] (the target's state at s_0, which depends on the encoder
    output alone): one step on the pair (the learned start feature, e(s_0)) =
    embeddings [B, 1, D] over the EMPTY `cache` (`init_cache`'s); the step's cache entry
    is dropped, so the cache stays empty and the first committed pair (f_0, s_1) takes
    position 0 as usual."""
    if not self.has_start:
      raise ValueError("this EAGLE head has no learned start (EagleConfig.start_feature)")
    B = embeddings_B1D.shape[0]
    start = jnp.broadcast_to(params["start"]["feature"], (B, 1, self.d_model))
    return self.step(params, cache, start, embeddings_B1D)[0][:, 0]

  def forward(self, params, encoded: t5.EncoderOutput, features_BTD, embeddings_BTD):
    """Teacher-forced predictions [B, T, D] of T pairs from an empty cache (training)."""
    cache = self.init_cache(params, encoded, features_BTD.shape[1])
    return self.step(params, cache, features_BTD, embeddings_BTD)[0]


head_checkpoints.register("eagle", EagleHead, what="an EAGLE head",
                          from_config=lambda d: EagleHead(EagleConfig.from_json(d)))
