"""T5.1.1 (and T5 1.0) encoder-decoder in JAX with an explicit, rewindable KV cache.

Parameters are a nested dict with T5X's names and 2-D kernel shapes, so T5X
checkpoints load by reading arrays (see `spec_decode.checkpoints`).

Axis letters used in einsums and shape suffixes:
  B batch, S source (encoder) length, T target tokens in this call,
  L cache length, N heads, H head dim, D model dim (emb_dim), F mlp dim,
  V vocab, K = N * H (joined heads).

The decoder has one code path: `decode(params, cache, tokens[B,T])` appends T
tokens at each row's own cache length. `forward` (teacher forcing) is
`decode` of all target tokens into a fresh cache, so the two cannot drift; the
Hugging Face parity test checks that path against an independent implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.kernels import cpu_matmul
from spec_decode.models import base, offload

Params = Mapping[str, Any]

PAD_ID, BOS_ID, EOS_ID = base.PAD_ID, base.BOS_ID, base.EOS_ID
_check_tokens = base.check_tokens
_NEG_INF = -1e10

# name: (emb_dim, num_heads, num_encoder_layers, num_decoder_layers, head_dim, mlp_dim)
_T5_1_1_SHAPES = {
    "small": (512, 6, 8, 8, 64, 1024),
    "base": (768, 12, 12, 12, 64, 2048),
    "large": (1024, 16, 24, 24, 64, 2816),
    "xl": (2048, 32, 24, 24, 64, 5120),
    "xxl": (4096, 64, 24, 24, 64, 10240),
}
_T5_1_0_SHAPES = {
    "small": (512, 8, 6, 6, 64, 2048),
    "base": (768, 12, 12, 12, 64, 3072),
    "large": (1024, 16, 24, 24, 64, 4096),
    "3b": (1024, 32, 24, 24, 128, 16384),
    "11b": (1024, 128, 24, 24, 128, 65536),
}
_SHAPE_FIELDS = ("emb_dim", "num_heads", "num_encoder_layers", "num_decoder_layers",
                 "head_dim", "mlp_dim")


def _presets() -> dict[str, dict[str, Any]]:
  out = {}
  for name, shape in _T5_1_1_SHAPES.items():
    out[f"t5_1_1_{name}"] = dict(zip(_SHAPE_FIELDS, shape), vocab_size=32128)
  for name, shape in _T5_1_0_SHAPES.items():
    out[f"t5_{name}"] = dict(zip(_SHAPE_FIELDS, shape), vocab_size=32128,
                             mlp_activations=("relu",), logits_via_embedding=True)
  # Tiny models for tests and CPU experiments (same architecture, small shapes).
  out["t5_1_1_tiny"] = dict(vocab_size=64, emb_dim=32, num_heads=4, num_encoder_layers=2,
                            num_decoder_layers=2, head_dim=8, mlp_dim=64)
  out["t5_1_1_mini"] = dict(vocab_size=128, emb_dim=64, num_heads=4, num_encoder_layers=2,
                            num_decoder_layers=3, head_dim=16, mlp_dim=128)
  out["t5_tiny"] = dict(out["t5_1_1_tiny"], mlp_activations=("relu",),
                        logits_via_embedding=True)
  return out


PRESETS = _presets()
_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "linear": lambda x: x,
}


@dataclasses.dataclass(frozen=True)
class T5Config:
  """T5 hyperparameters, with T5X's field names.

  `dtype` is the dtype of parameters, activations and the KV cache (float32 on
  CPU, bfloat16 on accelerators); norms and softmax always run in float32 and
  logits are returned in float32. A float64 model (under `jax_enable_x64`) runs
  everything in float64: the tests' reference for float32 parity.
  """
  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  mlp_activations: tuple[str, ...] = ("gelu", "linear")
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    for f in ("vocab_size", "emb_dim", "num_heads", "num_encoder_layers",
              "num_decoder_layers", "head_dim", "mlp_dim",
              "relative_attention_num_buckets", "relative_attention_max_distance"):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"T5Config.{f} must be a positive int, got {v!r}")
    bad = [a for a in self.mlp_activations if a not in _ACTIVATIONS]
    if bad or not self.mlp_activations:
      raise ValueError(f"T5Config.mlp_activations must be non-empty and drawn from "
                       f"{sorted(_ACTIVATIONS)}, got {self.mlp_activations!r}")
    if self.relative_attention_num_buckets % 2:
      raise ValueError("relative_attention_num_buckets must be even (bidirectional halves)")

  @classmethod
  def preset(cls, name: str, **overrides) -> "T5Config":
    """A named configuration, e.g. "t5_1_1_small"; fields may be overridden."""
    if name not in PRESETS:
      raise ValueError(f"Unknown T5 preset {name!r}; known presets: {sorted(PRESETS)}")
    return cls(**{**PRESETS[name], **overrides})

  def replace(self, **changes) -> "T5Config":
    return dataclasses.replace(self, **changes)

  @property
  def joined_kv(self) -> int:
    return self.num_heads * self.head_dim

  def mlp_names(self) -> tuple[str, ...]:
    """T5X names of the MLP input kernels: 'wi' for one activation, else wi_0, wi_1, ..."""
    if len(self.mlp_activations) == 1:
      return ("wi",)
    return tuple(f"wi_{i}" for i in range(len(self.mlp_activations)))


@flax.struct.dataclass
class EncoderOutput:
  """Encoder result.

  hidden: [B, S, D] final encoder states (after encoder_norm), config dtype.
  mask:   [B, S] bool, True at real (non-PAD) input positions.
  packed_index: [P] int32 or None: the flat positions b * S + s of the real tokens (B * S
          for padding) when the encoder ran packed (`T5.encode(packed_index=)`); the
          decoder's cross-attention K/V are then projected from those positions only.
          Not batch-first: drop it (None) before gathering batch rows.
  """
  hidden: jax.Array
  mask: jax.Array
  packed_index: Any = None

  def logical_axes(self) -> "EncoderOutput":
    return self.replace(hidden=("batch", "length", "embed"), mask=("batch", "length"))


@flax.struct.dataclass
class DecodeCache(base.LengthCache):
  """Per-layer decoder KV cache with a per-row length.

  self_k:           tuple over decoder layers of [B, N, H, L]; self_v: of
                    [B, N, L, H]. Positions >= a row's length hold stale values
                    that attention masks out.
  cross_k, cross_v: tuple over decoder layers of [B, N, H, S] and [B, N, S, H],
                    computed once.
  These are the operand layouts of attention's two batched products (q @ K
  contracts K's H, weights @ V contracts V's positions), so XLA multiplies the
  caches where they lie. With positions before heads (T5X's [B, L, N, H]) XLA
  copies every layer's whole K and V cache into that layout on every decode
  call: measured on the 2-core CPU, 3.7 of 33 ms of a 45.6M model's 5-token
  step at batch 8, plus slower products. (A one-token step at batch 1 with dots is the
  exception: XLA:CPU copies its caches; `ROWWISE_SELF_ATTENTION`, off by default.)
  encoder_mask:     [B, S] bool.
  lengths:          [B] int32, tokens already in the cache per row.
  """
  self_k: tuple[jax.Array, ...]
  self_v: tuple[jax.Array, ...]
  cross_k: tuple[jax.Array, ...]
  cross_v: tuple[jax.Array, ...]
  encoder_mask: jax.Array
  lengths: jax.Array

  POSITION_FIELDS = ("self_k", "self_v")
  POSITION_AXES = {"self_k": 3, "self_v": 2}

  @property
  def max_length(self) -> int:
    return self.self_v[0].shape[2]

  def logical_axes(self) -> "DecodeCache":
    """K [B,N,H,L] -> ('batch','heads','kv','length'), V [B,N,L,H] -> ('batch','heads',
    'length','kv'); mask and lengths batch-sharded."""
    k_axes, v_axes = ("batch", "heads", "kv", "length"), ("batch", "heads", "length", "kv")
    layers = lambda xs, axes: tuple(axes for _ in xs)
    return self.replace(self_k=layers(self.self_k, k_axes), self_v=layers(self.self_v, v_axes),
                        cross_k=layers(self.cross_k, k_axes), cross_v=layers(self.cross_v, v_axes),
                        encoder_mask=("batch", "length"), lengths=("batch",))


def relative_position_bucket(relative_position, *, bidirectional: bool, num_buckets: int,
                             max_distance: int):
  """T5's log-spaced bucket of (key position - query position).

  Half the buckets (per direction) are exact offsets, the rest grow
  logarithmically up to `max_distance`, beyond which all share the last bucket.
  """
  n = -relative_position
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(n.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  scaled = n.astype(jnp.float32) / max_exact + jnp.finfo(jnp.float32).eps
  log_part = jnp.log(scaled) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  large = jnp.minimum(max_exact + log_part.astype(n.dtype), num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


def _at_least_f32(dtype):
  """The dtype norms, softmax and logits are computed in: float32, or float64 for a
  float64 model (a reference run under `jax_enable_x64`)."""
  return jnp.promote_types(dtype, jnp.float32)


def _rms_norm(x, scale, eps):
  x32 = x.astype(_at_least_f32(x.dtype))
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class _Normed:
  """A projection's input rms_norm(x) * scale, not yet computed: a packed kernel computes
  the norm in its own call (`cpu_matmul.matmul(norm=)`: one launch instead of the norm's
  four fusions and the product), XLA's dot takes `value()`."""
  x: Any
  scale: Any
  eps: float

  def value(self):
    return _rms_norm(self.x, self.scale, self.eps)


def _attend(q_BTNH, k_BNHL, v_BNLH, bias_BNTL, mask_BTL):
  """Dot-product attention without 1/sqrt(H) (folded into the query init, as T5) over K/V
  in the cache's layouts (`DecodeCache`); bias_BNTL may be None. Both products are in
  the form XLA multiplies without moving K or V: [batch..., M, K] @ [batch..., K, N]."""
  q_BNTH = jnp.swapaxes(q_BTNH, 1, 2)
  logits = jnp.einsum("BNTH,BNHL->BNTL", q_BNTH, k_BNHL)
  logits = logits.astype(_at_least_f32(logits.dtype))
  if bias_BNTL is not None:
    logits = logits + bias_BNTL
  logits = jnp.where(mask_BTL[:, None], logits, _NEG_INF)
  weights = jax.nn.softmax(logits, axis=-1).astype(v_BNLH.dtype)
  return jnp.swapaxes(jnp.einsum("BNTL,BNLH->BNTH", weights, v_BNLH), 1, 2)


def _attend_rowwise(q_BTNH, k_BNHL, v_BNLH, bias_BNTL, mask_BTL):
  """`_attend` with both products as float32 multiplies summed along an axis instead of
  dots (see ROWWISE_SELF_ATTENTION for why)."""
  f32 = lambda x: x.astype(_at_least_f32(x.dtype))
  q_BNTH = jnp.swapaxes(q_BTNH, 1, 2)
  logits = jnp.sum(f32(q_BNTH)[..., None] * f32(k_BNHL)[:, :, None], axis=3)
  if bias_BNTL is not None:
    logits = logits + bias_BNTL
  logits = jnp.where(mask_BTL[:, None], logits, _NEG_INF)
  weights = jax.nn.softmax(logits, axis=-1).astype(v_BNLH.dtype)
  out = jnp.sum(f32(weights)[..., None] * f32(v_BNLH)[:, :, None], axis=3)
  return jnp.swapaxes(out.astype(v_BNLH.dtype), 1, 2)


def _attend_kernel(q_BTNH, k_BNHL, v_BNLH, bias_BNTL, mask_BTL):
  """`_attend` by the CPU kernel (`cpu_matmul.attention`), which reads each query's visible
  cache slots only; in the cache's dtype."""
  return cpu_matmul.attention(q_BTNH, k_BNHL, v_BNLH, bias_BNTL, mask_BTL).astype(v_BNLH.dtype)


# Whether attention runs in the CPU kernel (`cpu_matmul.attention`) instead of XLA's batched
# dots: the decoder's over its caches and the encoder's over the input. XLA's dots read every
# slot of the cache, filled or not, at a fraction of the memory's bandwidth: the big EnDe
# target's verify call of 5 tokens at batch 8 with 160 slots spent 2.9 ms of about 10 in them
# (profiled, AMD EPYC family 26 model 2); the kernel reads each query's visible slots only
# (an input's real tokens: the big CNN/DM target's encoder on ~280-token articles took 42.5
# ms against 48.5 with XLA's dots there). None: where the layer's weights are packed for the
# CPU kernel (`decode_params`: unsharded CPU runs); True: wherever the kernel is available
# (for A/B runs); False: XLA's dots. Read when a function is traced.
ATTENTION_KERNEL: bool | None = None


def _attention_kernel(layer_params) -> bool:
  """Whether a layer with params `layer_params` attends in the CPU kernel."""
  if ATTENTION_KERNEL is not None and not isinstance(ATTENTION_KERNEL, bool):
    raise ValueError(f"t5.ATTENTION_KERNEL must be None, True or False, got {ATTENTION_KERNEL!r}")
  if ATTENTION_KERNEL is False:
    return False
  packed = any(isinstance(leaf, cpu_matmul.PackedKernel) for leaf in jax.tree_util.tree_leaves(
      layer_params, is_leaf=lambda x: isinstance(x, cpu_matmul.PackedKernel)))
  return packed if ATTENTION_KERNEL is None else cpu_matmul.available()


def _attention_for(layer_params):
  """The attention a layer with params `layer_params` runs over all its keys at once: the CPU
  kernel's (`_attention_kernel`) or XLA's dots."""
  return _attend_kernel if _attention_kernel(layer_params) else _attend


def _pack_rows(x_BS_, index_P):
  """x [B, S, ...] at the flat positions index [P] -> [P, ...] (index B * S: zeros)."""
  B, S = x_BS_.shape[:2]
  flat = x_BS_.reshape((B * S,) + x_BS_.shape[2:])
  return jnp.take(jnp.concatenate([flat, jnp.zeros_like(flat[:1])]), index_P, axis=0)


def _unpack_rows(x_P_, index_P, B: int, S: int):
  """The inverse of `_pack_rows`: [P, ...] -> [B, S, ...], zeros where no index points."""
  out = jnp.zeros((B * S + 1,) + x_P_.shape[1:], x_P_.dtype).at[index_P].set(x_P_)
  return out[:B * S].reshape((B, S) + x_P_.shape[1:])


# Whether the CPU kernel skips an encoder input's padding rows (`_real_rows`); read when a
# function is traced. Off only to measure what skipping saves (experiments/setup_cost.py).
SKIP_PADDING_ROWS = True


# Whether a product of a single row (a one-token decode step at batch 1) is computed as
# one of two equal rows. XLA's GPU compiler rewrites a product with one row as a multiply
# and a reduction: two kernels per projection, the weight-sized product written to memory
# and read back, where two rows stay one GEMM kernel. Measured on an H100
# (experiments/results/gpu_h100): a T5.1.1-small step 209 -> 186 kernels, 0.386 -> 0.349 ms;
# T5.1.1-base 0.709 -> 0.592 ms. None: on GPU backends only; read when a function is traced.
# The stacking is a concatenation, which XLA runs as a kernel of its own before each
# product (an H200's T5.1.1-small-shaped step at batch 1: 49 such kernels of 177, against
# 125 kernels at batch 8; experiments/results/gpu_h200_one_row). "broadcast" stacks by
# broadcasting instead, which a GEMM fusion may take in as its operand; not yet measured
# on a GPU (`experiments.step_variants` variant one_row_as_two_broadcast).
ONE_ROW_AS_TWO: bool | str | None = None
ONE_ROW_MODES = (False, True, "broadcast")


def _one_row_as_two() -> bool | str:
  """False, True (stack by concatenation) or "broadcast"."""
  mode = jax.default_backend() == "gpu" if ONE_ROW_AS_TWO is None else ONE_ROW_AS_TWO
  if mode not in ONE_ROW_MODES:
    raise ValueError(f"t5.ONE_ROW_AS_TWO must be None or one of {ONE_ROW_MODES}, got {mode!r}")
  return mode


# Whether a one-token decoder step at batch 1 (the autoregressive loop's step, a draft's
# step) computes its self-attention's two products (query x cached keys, weights x cached
# values) as multiplies summed along an axis instead of dots. With dots, XLA:CPU copies every
# layer's K and V cache four times per such step: the step writes the new K/V into the cache
# in place, and XLA gives the dot, which reads the cache with its unit batch dimension
# dropped, a duplicate of that write, each needing its own copy of the whole cache (the big
# EnDe target with a 48-slot cache: 64 copies, 4.7 MB, per step). At batch 8, or with 5
# tokens, nothing is copied, and those keep the dots. Summed multiplies read the cache as it
# lies (tests/test_t5.py), and a step timed alone got faster (the big EnDe target: 1.90 ->
# 1.72 ms median), but end to end the speculative decoders got slower: on 16 EnDe test
# examples, alternating in one process (AMD EPYC), the small draft's decoder 0.386 -> 0.421 s
# and the exit adapter's 0.405 -> 0.443 s (median of 3 rounds), while the autoregressive
# decoder moved within the rounds' spread. So it is off by default; None: on the CPU
# backend only; read when a function is traced.
ROWWISE_SELF_ATTENTION: bool | None = False


def _rowwise_self_attention() -> bool:
  return base.on_cpu_unless_set(ROWWISE_SELF_ATTENTION, "t5.ROWWISE_SELF_ATTENTION")


# The same for the one-token part of `decode_reusing` (the first layers on the last proposed
# token, at batch 1): there the rowwise form pays. With dots XLA:CPU copied those layers' K/V
# caches in every verify call (the tiny model's decoding loop: 8 more whole-cache copies per
# reused layer; none in the rowwise form), and on the big EnDe target with its exit adapter
# (k = 1, 16 examples, 9 interleaved rounds, AMD EPYC family 25 model 17) reuse gained
# 1.07X (median per round; 1.03X over the fastest calls) in the rowwise form and 1.00X with
# dots. None: on the CPU backend only; read when a function is traced.
REUSE_ROWWISE_SELF_ATTENTION: bool | None = None


def _reuse_rowwise_self_attention() -> bool:
  return base.on_cpu_unless_set(REUSE_ROWWISE_SELF_ATTENTION, "t5.REUSE_ROWWISE_SELF_ATTENTION")


_SWITCHES = ("SKIP_PADDING_ROWS", "ONE_ROW_AS_TWO", "ROWWISE_SELF_ATTENTION",
             "REUSE_ROWWISE_SELF_ATTENTION", "ATTENTION_KERNEL", "ROW_WRITES")


@contextlib.contextmanager
def switched(**values):
  """Sets trace-time switches of this module (`_SWITCHES`) inside the block, for A/B
  measurements. When that changes one, compiled programs are dropped (`jax.clear_caches`)
  on entry and again on exit, so functions trace with the setting in force; programs
  compiled inside the block (`jax.jit(f).lower(...).compile()`) keep it."""
  unknown = sorted(set(values) - set(_SWITCHES))
  if unknown:
    raise ValueError(f"unknown t5 switches {unknown}; known: {list(_SWITCHES)}")
  module = globals()
  old = {name: module[name] for name in values}
  changed = any(old[name] != value for name, value in values.items())
  if changed:
    module.update(values)
    jax.clear_caches()
  try:
    yield
  finally:
    if changed:
      module.update(old)
      jax.clear_caches()


def _real_rows(mask_BS, packed_index=None):
  """How many leading rows of an encoder's products are not all padding (int32 scalar):
  packed, the real tokens (`base.packing_index` puts them first, its padding after);
  else the flat positions [B * S] up to the last real token. The CPU kernel multiplies
  those rows only (`cpu_matmul.matmul(rows=)`): the rest are padding, masked everywhere.
  None (every row) when SKIP_PADDING_ROWS is off."""
  if not SKIP_PADDING_ROWS:
    return None
  if packed_index is not None:
    return jnp.sum(packed_index < mask_BS.size, dtype=jnp.int32)
  flat = mask_BS.reshape(-1)
  return jnp.max(jnp.where(flat, jnp.arange(1, flat.size + 1, dtype=jnp.int32), 0))


# Inputs of at least this many positions (after trimming) run the set-up without XLA's
# transposed copies (`cpu_matmul.self_attention`, `cpu_matmul.kv_layout`); shorter ones keep
# the split path. Measured where the copies cost (the CNN/DM target's 320-token articles:
# ~40 copies of 60-100 us each, the set-up 22.2 -> 20.4-21.2 ms); on the 32-token EnDe
# inputs, where the copies are small, the EnDe main job's runs spread more than any gain
# (AMD EPYC family 26), so they keep the path they had. Read when a function is traced.
SET_UP_LAYOUT_MIN_LENGTH = 128


def _kv_layout(k_BLNH, v_BLNH):
  """Projected K and V [B, L, N, H] in the cache's layouts: K [B, N, H, L], V [B, N, L, H]."""
  return jnp.transpose(k_BLNH, (0, 2, 3, 1)), jnp.swapaxes(v_BLNH, 1, 2)


def empty_self_kv(config: T5Config, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
  """One layer's empty self-attention cache: zeros K [B, N, H, L] and V [B, N, L, H]."""
  N, H = config.num_heads, config.head_dim
  return (jnp.zeros((batch, N, H, length), config.dtype),
          jnp.zeros((batch, N, length, H), config.dtype))


# How a decode call writes its new tokens' K and V into the self-attention cache, each row
# at its own length. vmapped, `dynamic_update_slice` becomes a scatter that drops an
# out-of-bounds update; at batch 1 XLA:CPU turns it into a dynamic-update-slice under a
# select, and in the timing loops (`timing.decode_loop`, behind T_p, T_verify and
# experiments.roofline / loop_split) it computed each write's indices and in-bounds test
# in two more small kernels of its own: 32 of the big EnDe target's 162 launches per step,
# all ready at once, which XLA's thunk executor hands to its thread pool. That made a
# step timed alone cost more than in the decoding loops, where the scatter form adds 5
# kernels to the autoregressive body, not 32: the big EnDe target's one-token step at batch 1
# timed 0.906 ms against 0.731 with one plain in-place dynamic-update-slice per row, and
# the big CNN/DM target's 6-token call 1.445 against 1.320 ms (AMD EPYC family 26, 21-31
# interleaved rounds), and experiments.loop_split read a FixedProposal body 0.07-0.12 ms
# cheaper than its own verify call. The decoding loops themselves run as fast either way
# (50 EnDe examples, 9 interleaved rounds in one process: autoregressive 0.813 / 0.795 s
# per row / scatter, speculative 0.409 / 0.406 s; batch 8 with refill within 1.3%). So
# the writes are per row, and the timing loops time what the decoding loops run. The
# decoding loops size their caches so that no write leaves them (`LengthCache.check_append`
# refuses one outside a jit), so the plain write's clamping never applies. With XLA's dots
# reading the cache the plain writes made XLA copy whole caches (tests/test_t5.py), so
# such layers keep the scatter. True: per row (unrolled, B writes per cache) up to
# ROW_WRITES_MAX_BATCH rows; False: the vmapped scatter; None: per row where the layer
# attends in the CPU kernel (`_attention_kernel`); read when a function is traced.
ROW_WRITES: bool | None = None
ROW_WRITES_MAX_BATCH = 32


def _row_writes(layer_params) -> bool:
  """Whether a layer with params `layer_params` writes its cache per row (`ROW_WRITES`)."""
  if ROW_WRITES is not None and not isinstance(ROW_WRITES, bool):
    raise ValueError(f"t5.ROW_WRITES must be None, True or False, got {ROW_WRITES!r}")
  return _attention_kernel(layer_params) if ROW_WRITES is None else ROW_WRITES


def _write_rows(cache, new, offsets_B, axis, rows: bool = False):
  """Writes `new` into each row of `cache` at that row's own offset along `axis`: one
  dynamic-update-slice per row where `rows` (`_row_writes`; batches up to
  ROW_WRITES_MAX_BATCH), else a vmapped one (a scatter)."""
  new = new.astype(cache.dtype)
  if rows and cache.shape[0] <= ROW_WRITES_MAX_BATCH:
    zero = jnp.zeros((), offsets_B.dtype)
    for b in range(cache.shape[0]):
      start = [zero] * cache.ndim
      start[0], start[axis] = jnp.asarray(b, offsets_B.dtype), offsets_B[b]
      cache = jax.lax.dynamic_update_slice(cache, new[b:b + 1], start)
    return cache
  write = lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(c, u, s, axis=axis - 1)
  return jax.vmap(write)(cache, new, offsets_B)


@dataclasses.dataclass(frozen=True)
class T5(base.ParamSpecs):
  """A T5 model: pure functions of (params, inputs). Hashable, so jit-static.

  stream_params: the parameters live in host memory (`offload.to_host`) and each
    call moves every layer's weights (and the embedding, relative-position
    tables, norms and LM head) to the device right before use, with one layer of
    prefetch (`offload.fetch`), so a model larger than device memory runs. The
    building blocks `cross_kv` and `decoder_layer` take device-resident layers.
  kernel_weights: how `decode_params` stores the weights it packs for the CPU decoding
    kernel: 'auto' (default: bfloat16 when every packed weight is a bfloat16 value, as
    for a checkpoint stored in bfloat16, which gives the float32 model's bits at half the
    bytes; else float32), 'float32', 'bfloat16' (rounds float32 weights), 'int8' (per
    column scales) or 'bfloat16_dot' (bfloat16 weights and activations in AVX512-BF16 dot
    products, float32 sums: twice the multiply-adds per instruction, for compute-bound
    batches). The last three change the model's function; see `cpu_matmul.pack`. Or
    'bfloat16_dot_if_supported': 'bfloat16_dot' on a CPU with AVX512-BF16, else 'auto' (for
    configs that run anywhere). On a 2-core AMD EPYC of x86 family 25, model 17, with the
    big EnDe demo target, 'bfloat16_dot' took a one-token step's products from 1.17-1.23 ms
    to 0.91 ms and a 5-token verify call's from 1.50-1.65 to 1.23-1.36 ms; the default
    job's greedy outputs stayed those of 'auto' (50 of 50), its speedup did not move beyond
    the runs' spread (1.72-1.99X against 1.54-1.82X, five runs each in turns), so the demo
    configs keep 'auto'.
  setup_kernel_weights: the same for the weights only the per-example set-up multiplies by
    (every encoder layer's, and each decoder layer's cross-attention key/value: `encode`
    and `init_cache`), which multiply a whole input of rows at once, so are bound by the
    CPU's multiply-adds, not by reading the weights as a decode step is: 'same' (default:
    as `kernel_weights`), one of `kernel_weights`' settings, or 'bfloat16_dot_if_supported'
    ('bfloat16_dot' on a CPU with AVX512-BF16, else 'same'; for configs that run
    anywhere). With bfloat16 dot products the encoder's attention between them runs in
    them too (`cpu_matmul.self_attention(dot=True)`: q, K, the weights and V in bfloat16,
    float32 sums, as an encoder on a TPU attends). Anything but 'same' changes the model's
    function (the encoder's states); every decoder of an experiment uses the same model, so
    their comparison stays exact.
  packed_min_elements: the smallest weight matrix (in elements) `decode_params` packs for
    the CPU kernel; None (default): `cpu_matmul.MIN_PACKED_ELEMENTS`. A larger value keeps
    the small matrices on XLA's dots (and their layers on XLA's attention), for A/B runs of
    the two layouts (`experiments.draft_layout`); the values differ by float rounding only.
  """
  config: T5Config
  stream_params: bool = False
  kernel_weights: str = "auto"
  setup_kernel_weights: str = "same"
  packed_min_elements: int | None = None
  supports_packed_encoding = True  # encode(packed_index=): see `base.packing_index`

  def __post_init__(self):
    if not isinstance(self.stream_params, bool):
      raise ValueError(f"T5.stream_params must be True or False, got {self.stream_params!r}")
    if self.kernel_weights not in KERNEL_WEIGHTS:
      raise ValueError(f"T5.kernel_weights must be one of {KERNEL_WEIGHTS}, got "
                       f"{self.kernel_weights!r}")
    if self.setup_kernel_weights not in SETUP_WEIGHTS:
      raise ValueError(f"T5.setup_kernel_weights must be one of {SETUP_WEIGHTS}, got "
                       f"{self.setup_kernel_weights!r}")
    m = self.packed_min_elements
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
      raise ValueError(f"T5.packed_min_elements must be None or an int >= 0, got {m!r}")

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def _get(self, tree, after):
    """`tree` moved to device memory once `after` exists when streaming parameters, else
    `tree` itself (see `offload.fetch`)."""
    return offload.fetch(tree, after) if self.stream_params else tree

  # ------------------------------------------------------------------ params
  def _param_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], Any]]:
    """Flat {path: (shape, logical axes, initializer)} in T5X naming."""
    c = self.config
    E, K, F, V, N = c.emb_dim, c.joined_kv, c.mlp_dim, c.vocab_size, c.num_heads
    init = jax.nn.initializers
    fan_in_normal = init.variance_scaling(1.0, "fan_in", "normal")
    query_init = lambda k, s, d: fan_in_normal(k, s, d) / math.sqrt(c.head_dim)
    mlp_init = init.variance_scaling(1.0, "fan_in", "truncated_normal")
    relpos_init = init.variance_scaling(1.0, "fan_avg", "uniform")
    ones = init.ones
    specs = {"token_embedder/embedding": ((V, E), ("vocab", "embed"), init.normal(1.0))}

    def attention(prefix):
      specs[f"{prefix}/query/kernel"] = ((E, K), ("embed", "joined_kv"), query_init)
      for n in ("key", "value"):
        specs[f"{prefix}/{n}/kernel"] = ((E, K), ("embed", "joined_kv"), fan_in_normal)
      specs[f"{prefix}/out/kernel"] = ((K, E), ("joined_kv", "embed"), fan_in_normal)

    def mlp(prefix):
      for n in c.mlp_names():
        specs[f"{prefix}/mlp/{n}/kernel"] = ((E, F), ("embed", "mlp"), mlp_init)
      specs[f"{prefix}/mlp/wo/kernel"] = ((F, E), ("mlp", "embed"), mlp_init)

    def norm(path):
      specs[path] = ((E,), ("embed",), ones)

    relpos = ((N, c.relative_attention_num_buckets), ("heads", "relpos_buckets"), relpos_init)
    specs["encoder/relpos_bias/rel_embedding"] = relpos
    for i in range(c.num_encoder_layers):
      p = f"encoder/layers_{i}"
      norm(f"{p}/pre_attention_layer_norm/scale")
      attention(f"{p}/attention")
      norm(f"{p}/pre_mlp_layer_norm/scale")
      mlp(p)
    norm("encoder/encoder_norm/scale")
    specs["decoder/relpos_bias/rel_embedding"] = relpos
    for i in range(c.num_decoder_layers):
      p = f"decoder/layers_{i}"
      norm(f"{p}/pre_self_attention_layer_norm/scale")
      attention(f"{p}/self_attention")
      norm(f"{p}/pre_cross_attention_layer_norm/scale")
      attention(f"{p}/encoder_decoder_attention")
      norm(f"{p}/pre_mlp_layer_norm/scale")
      mlp(p)
    norm("decoder/decoder_norm/scale")
    if not c.logits_via_embedding:
      specs["decoder/logits_dense/kernel"] = ((E, V), ("embed", "vocab"), mlp_init)
    return specs


  # ---------------------------------------------------------------- building blocks
  def embed(self, params, tokens):
    """Token embeddings [B, T, D] (the decoder's and encoder's input), config dtype."""
    return self._embed(params, tokens)

  def _embed(self, params, tokens):
    table_VD = self._get(params["token_embedder"]["embedding"], tokens)
    return jnp.take(table_VD, tokens, axis=0).astype(self.config.dtype)

  def _dense(self, x_BTI, kernel_IO, rows=None):
    """x [B, T, I] (or a `_Normed` input) @ kernel [I, O]: XLA's dot, or the CPU decoding
    kernel when the kernel was packed for it (`decode_params`). rows: the kernel multiplies
    only the first `rows` of the B * T rows (the rest are padding to the caller, and come
    back as zeros; `_real_rows`); XLA's dot multiplies them all."""
    if isinstance(kernel_IO, cpu_matmul.PackedKernel):  # packed only for float32 models
      if isinstance(x_BTI, _Normed):
        return cpu_matmul.matmul(x_BTI.x, kernel_IO, norm=x_BTI.scale, eps=x_BTI.eps,
                                 rows=rows)
      return cpu_matmul.matmul(x_BTI, kernel_IO, rows=rows)
    if isinstance(x_BTI, _Normed):
      x_BTI = x_BTI.value()
    kernel_IO = kernel_IO.astype(self.config.dtype)
    mode = _one_row_as_two() if x_BTI.shape[:2] == (1, 1) else False
    if mode:  # a GEMM, not a multiply-reduce
      x_BTI = (jnp.broadcast_to(x_BTI, (1, 2, x_BTI.shape[2])) if mode == "broadcast"
               else jnp.concatenate([x_BTI, x_BTI], axis=1))
      return jnp.einsum("BTI,IO->BTO", x_BTI, kernel_IO)[:, :1]
    return jnp.einsum("BTI,IO->BTO", x_BTI, kernel_IO)

  def _project_heads(self, x_BTD, kernel_DK, rows=None):
    c = self.config
    y = self._dense(x_BTD, kernel_DK, rows)
    return y.reshape(*y.shape[:2], c.num_heads, c.head_dim)

  def _merge_heads(self, y_BTNH, kernel_KD, rows=None):
    return self._dense(y_BTNH.reshape(*y_BTNH.shape[:2], -1), kernel_KD, rows)

  def _heads(self, x_BTD, a, names, rows=None):
    """The projections `names` of attention params `a` [B, T, N, H] each: one product with
    their joined kernel when `decode_params` joined them (`JOINED`), else one per name."""
    joined = JOINED.get(names)
    if joined in a:
      c = self.config
      y = self._dense(x_BTD, a[joined]["kernel"], rows)
      K = c.joined_kv
      return tuple(y[..., i * K:(i + 1) * K].reshape(*y.shape[:2], c.num_heads, c.head_dim)
                   for i in range(len(names)))
    return tuple(self._project_heads(x_BTD, a[n]["kernel"], rows) for n in names)

  def _mlp(self, p, x_BTD, rows=None):
    c = self.config
    names = c.mlp_names()
    if JOINED_MLP in p:  # the input kernels joined by `decode_params`: one product
      y = self._dense(x_BTD, p[JOINED_MLP]["kernel"], rows)
      F = c.mlp_dim
      parts = [y[..., i * F:(i + 1) * F] for i in range(len(names))]
    else:
      parts = [self._dense(x_BTD, p[name]["kernel"], rows) for name in names]
    h = None
    for part, act in zip(parts, c.mlp_activations):
      a = _ACTIVATIONS[act](part)
      h = a if h is None else h * a
    return self._dense(h, p["wo"]["kernel"], rows)

  def _relpos_bias(self, rel_embedding_NR, rel_pos, bidirectional):
    """rel_pos [..., T, L] (key - query) -> bias [..., N, T, L] float32."""
    c = self.config
    buckets = relative_position_bucket(
        rel_pos, bidirectional=bidirectional, num_buckets=c.relative_attention_num_buckets,
        max_distance=c.relative_attention_max_distance)
    bias = jnp.take(rel_embedding_NR.astype(_at_least_f32(c.dtype)), buckets, axis=1)  # [N,...,T,L]
    return jnp.moveaxis(bias, 0, -3)

  # ---------------------------------------------------------------- encoder
  def encode(self, params: Params, encoder_tokens, packed_index=None) -> EncoderOutput:
    """Runs the encoder once. encoder_tokens [B, S] int, 0 = padding.

    packed_index [P] int32 (`base.packing_index(encoder_tokens)`): run the encoder's
    projections and MLPs on the P positions it names only (the real tokens of every row,
    packed; attention still runs per row), instead of on all B * S positions. A batch of
    rows of different lengths padded to the longest then costs what its real tokens
    cost. The states of real tokens are the same (PAD positions are masked everywhere
    and come back as zeros).
    """
    encoder_tokens = _check_tokens(encoder_tokens, "encoder_tokens", self.config.vocab_size)
    if packed_index is not None:
      packed_index = jnp.asarray(packed_index)
      if packed_index.ndim != 1 or not jnp.issubdtype(packed_index.dtype, jnp.integer):
        raise ValueError(f"packed_index must be a 1-D integer array, got "
                         f"{packed_index.dtype} {packed_index.shape}")
      packed_index = packed_index.astype(jnp.int32)
    return self._encode(params, encoder_tokens, packed_index)

  @functools.partial(jax.jit, static_argnums=0)
  def _encode(self, params, encoder_tokens, packed_index=None):
    c = self.config
    enc = params["encoder"]
    mask_BS = encoder_tokens > 0
    x = self._embed(params, encoder_tokens)
    B, S = encoder_tokens.shape
    packed = packed_index is not None
    # Packed: x holds the P named positions as one row [1, P, D]; attention unpacks them.
    pack = (lambda y: _pack_rows(y, packed_index)[None]) if packed else (lambda y: y)
    unpack = (lambda y: _unpack_rows(y[0], packed_index, B, S)) if packed else (lambda y: y)
    x = pack(x)
    pos = jnp.arange(S)
    bias = self._relpos_bias(self._get(enc["relpos_bias"]["rel_embedding"], encoder_tokens),
                             pos[None, :] - pos[:, None], bidirectional=True)[None]  # [1,N,S,S]
    attn_mask = jnp.broadcast_to(mask_BS[:, None, :], (B, S, S))
    rows = _real_rows(mask_BS, packed_index)  # the products skip the padding rows after it
    toeplitz = None  # the bias by key - query [N, 2S - 1], for the kernel's self_attention
    x_prev = x  # the previous layer's input: what this layer's streamed weights wait for
    for i in range(c.num_encoder_layers):
      p = self._get(enc[f"layers_{i}"], x_prev)
      x_prev = x
      h = _Normed(x, p["pre_attention_layer_norm"]["scale"], c.layer_norm_epsilon)
      a = p["attention"]
      attend = _attention_for(p)
      if attend is _attend_kernel and JOINED_QKV in a and S >= SET_UP_LAYOUT_MIN_LENGTH:
        # the kernel reads q, K and V where the joined product left them (no transposes)
        kernel = a[JOINED_QKV]["kernel"]
        qkv = unpack(self._dense(h, kernel, rows))
        if toeplitz is None:
          toeplitz = self._relpos_bias(
              self._get(enc["relpos_bias"]["rel_embedding"], encoder_tokens),
              jnp.arange(1 - S, S)[None], bidirectional=True)[:, 0]  # [N, 2S - 1]
        # products in bfloat16 dot products (setup_kernel_weights 'bfloat16_dot'): so is
        # the attention between them, where the head_dim allows
        dot = kernel.pairs and cpu_matmul.dot_attention_head_dim(c.head_dim)
        out = cpu_matmul.self_attention(qkv, toeplitz, mask_BS, c.num_heads,
                                        dot=dot).astype(qkv.dtype)
      else:
        q, k, v = (unpack(y) for y in self._heads(h, a, ("query", "key", "value"), rows))
        out = attend(q, *_kv_layout(k, v), bias, attn_mask)
      x = x + self._merge_heads(pack(out), a["out"]["kernel"], rows)
      h = _Normed(x, p["pre_mlp_layer_norm"]["scale"], c.layer_norm_epsilon)
      x = x + self._mlp(p["mlp"], h, rows)
    x = _rms_norm(x, self._get(enc["encoder_norm"]["scale"], x_prev), c.layer_norm_epsilon)
    return EncoderOutput(hidden=unpack(x), mask=mask_BS, packed_index=packed_index)

  # ---------------------------------------------------------------- decoder
  def init_cache(self, params: Params, encoded: EncoderOutput, max_decode_len: int) -> DecodeCache:
    """Empty self-attention cache of `max_decode_len` slots; cross-attention K/V filled."""
    if not isinstance(max_decode_len, (int, np.integer)) or max_decode_len < 1:
      raise ValueError(f"max_decode_len must be a positive int, got {max_decode_len!r}")
    return self._init_cache(params, encoded, int(max_decode_len))

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def _init_cache(self, params, encoded, max_decode_len):
    c = self.config
    B = encoded.hidden.shape[0]
    cross_k, cross_v = [], []
    for i in range(c.num_decoder_layers):
      a = params["decoder"][f"layers_{i}"]["encoder_decoder_attention"]
      kernels = {"encoder_decoder_attention": {n: v for n, v in a.items() if n != "query"}}
      # Streamed, layer i's kernels wait for layer i - 2's K: one layer of prefetch.
      k, v = self.cross_kv(self._get(kernels, encoded.hidden if i < 2 else cross_k[i - 2]),
                           encoded.hidden, packed_index=encoded.packed_index,
                           mask=encoded.mask)
      cross_k.append(k)
      cross_v.append(v)
    empty_k, empty_v = empty_self_kv(c, B, max_decode_len)
    return DecodeCache(
        self_k=tuple(empty_k for _ in range(c.num_decoder_layers)),
        self_v=tuple(empty_v for _ in range(c.num_decoder_layers)),
        cross_k=tuple(cross_k), cross_v=tuple(cross_v),
        encoder_mask=encoded.mask, lengths=jnp.zeros((B,), jnp.int32))

  def decode(self, params: Params, cache: DecodeCache, tokens, *, positions=None,
             tree_mask=None, layers: tuple[int, ...] = ()) -> base.DecodeOutput:
    """Appends tokens [B, T] at each row's cache length (slots lengths .. lengths + T - 1).

    By default token t of row b sits at position lengths[b] + t and attends to
    the cached prefix and to new tokens j <= t. `positions` [B, T] and
    `tree_mask` [B, T, T] override the new tokens' positions (relative-position
    buckets come from them) and which new tokens each one sees (see
    `models.base`). Returns float32 logits [B, T, V], the final decoder states
    [B, T, D] and the cache with lengths + T; with `layers` (decoder layer indices) also
    the residual streams after those layers as `features` [B, T, len(layers) * D]
    (multi-layer features for EAGLE-3-style heads).
    """
    tokens = _check_tokens(tokens, "tokens", self.config.vocab_size)
    positions, tree_mask = base.check_tree_args(tokens, positions, tree_mask)
    cache.check_append(tokens)
    layers = tuple(int(i) for i in layers)
    bad = [i for i in layers if not 0 <= i < self.config.num_decoder_layers]
    if bad:
      raise ValueError(f"decode: layers {bad} are not decoder layers of this model (0 .. "
                       f"{self.config.num_decoder_layers - 1})")
    return self._decode(params, cache, tokens, positions, tree_mask, layers)

  def self_attention_geometry(self, rel_embedding_NR, offsets_B, T: int, L: int,
                              positions=None, tree_mask=None):
    """(bias [B, N, T, L] float32, mask [B, T, L] bool) of T new tokens' self-attention
    over a cache of L slots whose rows already hold offsets_B tokens (see `decode`)."""
    B = offsets_B.shape[0]
    slot_L = jnp.arange(L)
    if positions is None and tree_mask is None:  # a chain: slot == position, causal
      q_pos_BT = offsets_B[:, None] + jnp.arange(T)[None, :]
      rel_BTL = slot_L[None, None, :] - q_pos_BT[:, :, None]
      self_mask = slot_L[None, None, :] <= q_pos_BT[:, :, None]  # [B, T, L]
    else:
      q_pos_BT = offsets_B[:, None] + jnp.arange(T)[None, :] if positions is None else positions
      if tree_mask is None:
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
      new_j_BL = slot_L[None, :] - offsets_B[:, None]  # which new token a slot holds
      is_new_BL = (new_j_BL >= 0) & (new_j_BL < T)
      j_BL = jnp.clip(new_j_BL, 0, T - 1)
      k_pos_BL = jnp.where(is_new_BL, jnp.take_along_axis(q_pos_BT, j_BL, axis=1), slot_L[None])
      rel_BTL = k_pos_BL[:, None, :] - q_pos_BT[:, :, None]
      sees_new_BTL = jnp.take_along_axis(tree_mask, jnp.broadcast_to(j_BL[:, None, :],
                                                                     (B, T, L)), axis=2)
      self_mask = (new_j_BL < 0)[:, None, :] | (is_new_BL[:, None, :] & sees_new_BTL)
    bias = self._relpos_bias(rel_embedding_NR, rel_BTL, bidirectional=False)
    return bias, self_mask

  def cross_kv(self, layer_params, encoder_hidden_BSD, packed_index=None, mask=None):
    """One decoder layer's cross-attention K [B, N, H, S] and V [B, N, S, H] of encoder
    states (the cache's layouts, `DecodeCache`); with packed_index (`EncoderOutput`)
    projected from the real tokens' positions only (zeros at PAD positions, which
    cross-attention masks). mask [B, S] (the encoder's): the CPU kernel skips the padding
    rows after the last real token (their K/V are zeros; cross-attention masks them)."""
    a = layer_params["encoder_decoder_attention"]
    rows = None if mask is None else _real_rows(mask, packed_index)
    B, S = encoder_hidden_BSD.shape[:2]
    unpack = lambda y: y if packed_index is None else _unpack_rows(y[0], packed_index, B, S)
    h = encoder_hidden_BSD if packed_index is None else _pack_rows(encoder_hidden_BSD,
                                                                   packed_index)[None]
    if (isinstance(a.get(JOINED_KV, {}).get("kernel"), cpu_matmul.PackedKernel)
        and S >= SET_UP_LAYOUT_MIN_LENGTH):
      # one product, copied into the cache's layouts on the kernel's threads
      k, v = cpu_matmul.kv_layout(unpack(self._dense(h, a[JOINED_KV]["kernel"], rows)),
                                  self.config.num_heads)
      return k.astype(self.config.dtype), v.astype(self.config.dtype)  # as the split path's
    return _kv_layout(*(unpack(y) for y in self._heads(h, a, ("key", "value"), rows)))

  def decoder_layer(self, p, x_BTD, self_k_BNHL, self_v_BNLH, offsets_B, self_bias, self_mask,
                    cross_k_BNHS, cross_v_BNSH, cross_mask_BTS, rowwise=None):
    """One T5 decoder block (self-attention, cross-attention, MLP, each pre-normed and
    residual) on x [B, T, D] with T5X-named layer params `p`. The new tokens' K/V are
    written into the cache rows at `offsets_B`; returns (x, self_k, self_v). rowwise: the
    self-attention of a one-token call at batch 1 as summed multiplies
    (ROWWISE_SELF_ATTENTION; None: as that switch says)."""
    c = self.config
    h = _Normed(x_BTD, p["pre_self_attention_layer_norm"]["scale"], c.layer_norm_epsilon)
    a = p["self_attention"]
    q, k, v = self._heads(h, a, ("query", "key", "value"))
    k, v = _kv_layout(k, v)
    rows = _row_writes(p)
    k_all = _write_rows(self_k_BNHL, k, offsets_B, DecodeCache.POSITION_AXES["self_k"], rows)
    v_all = _write_rows(self_v_BNLH, v, offsets_B, DecodeCache.POSITION_AXES["self_v"], rows)
    one_row = x_BTD.shape[0] == 1 and x_BTD.shape[1] == 1
    if rowwise is None:
      rowwise = _rowwise_self_attention()
    cross = _attention_for(p)
    attend = (cross if cross is _attend_kernel else
              _attend_rowwise if one_row and rowwise else _attend)
    x = x_BTD + self._merge_heads(attend(q, k_all, v_all, self_bias, self_mask),
                                  a["out"]["kernel"])
    h = _Normed(x, p["pre_cross_attention_layer_norm"]["scale"], c.layer_norm_epsilon)
    a = p["encoder_decoder_attention"]
    q = self._project_heads(h, a["query"]["kernel"])
    x = x + self._merge_heads(cross(q, cross_k_BNHS, cross_v_BNSH, None, cross_mask_BTS),
                              a["out"]["kernel"])
    h = _Normed(x, p["pre_mlp_layer_norm"]["scale"], c.layer_norm_epsilon)
    return x + self._mlp(p["mlp"], h), k_all, v_all

  @functools.partial(jax.jit, static_argnums=(0, 6))
  def _decode(self, params, cache: DecodeCache, tokens, positions=None, tree_mask=None,
              layers: tuple[int, ...] = ()):
    dec = params["decoder"]
    B, T = tokens.shape
    offsets = cache.lengths
    geometry = self.self_attention_geometry(
        self._get(dec["relpos_bias"]["rel_embedding"], tokens), offsets, T, cache.max_length,
        positions, tree_mask)
    x = self._embed(params, tokens)
    x, x_prev, new_k, new_v, after = self._decoder_layers(
        dec, cache, range(self.config.num_decoder_layers), x, x, offsets, geometry)
    return self._decoded(params, cache.replace(self_k=tuple(new_k), self_v=tuple(new_v),
                                               lengths=offsets + T),
                         x, x_prev, jnp.concatenate([after[i] for i in layers], axis=-1)
                         if layers else None)

  def _decoder_layers(self, dec, cache: DecodeCache, indices, x, x_prev, offsets, geometry,
                      self_kv=None, rowwise=None):
    """Decoder layers `indices` on x [B, T, D], their new tokens written at `offsets`;
    geometry: (bias, mask) of `self_attention_geometry`; self_kv: the layers' (K, V)
    caches when not the cache's own. x_prev: what the first layer's streamed weights wait
    for. Returns (x, x_prev, K caches, V caches, {layer: its output stream})."""
    T = x.shape[1]
    cross_mask = jnp.broadcast_to(cache.encoder_mask[:, None, :],
                                  (x.shape[0], T, cache.encoder_mask.shape[1]))
    new_k, new_v, after = [], [], {}
    for n, i in enumerate(indices):
      p = self._get(dec[f"layers_{i}"], x_prev)
      x_prev = x
      k, v = (cache.self_k[i], cache.self_v[i]) if self_kv is None else self_kv[n]
      x, k_all, v_all = self.decoder_layer(p, x, k, v, offsets, *geometry, cache.cross_k[i],
                                           cache.cross_v[i], cross_mask, rowwise)
      new_k.append(k_all)
      new_v.append(v_all)
      after[i] = x
    return x, x_prev, new_k, new_v, after

  def _decoded(self, params, cache, x, x_prev, features=None) -> base.DecodeOutput:
    """The decode call's output from the last layer's stream x: the final norm, the LM head."""
    dec = params["decoder"]
    norm, head = self._get((dec["decoder_norm"]["scale"], self._head_kernel(params)), x_prev)
    normed = _Normed(x, norm, self.config.layer_norm_epsilon)  # the logits' input, states out
    return base.DecodeOutput(logits=self._logits(head, normed), cache=cache,
                             hidden=normed.value(), features=features)

  def decode_reusing(self, params: Params, cache: DecodeCache, tokens, *, streams,
                     shallow_k, shallow_v) -> base.DecodeOutput:
    """`decode(params, cache, tokens)` of a chain whose first T - 1 tokens already went
    through this model's first k decoder layers in other calls with the same parameters
    (self-speculation, `drafters.layer_skip`: the draft is those layers), so layers
    0 .. k - 1 run on the last token only and layers k .. on all T.

    streams [B, T - 1, D]: the residual streams after layer k - 1 of tokens 0 .. T - 2.
    shallow_k, shallow_v: tuples over layers 0 .. k - 1 of caches laid out as this model's
    (`DecodeCache.self_k`, `self_v`; any number of slots) holding those tokens' K and V at
    slots lengths .. lengths + T - 2 (the draft's cache after its proposal); they are
    copied into this cache. The logits equal `decode`'s up to float rounding (the first
    layers ran in other calls). Returns what `decode` returns (features None)."""
    tokens = _check_tokens(tokens, "tokens", self.config.vocab_size)
    cache.check_append(tokens)
    B, T = tokens.shape
    k, n, D = len(shallow_k), self.config.num_decoder_layers, self.config.emb_dim
    if not 1 <= k < n or len(shallow_v) != k:
      raise ValueError(f"decode_reusing: shallow_k and shallow_v must cover the same 1 .. "
                       f"{n - 1} first decoder layers, got {k} and {len(shallow_v)}")
    if T < 2 or tuple(streams.shape) != (B, T - 1, D):
      raise ValueError(f"decode_reusing: streams must be [B, T - 1, D] = {(B, T - 1, D)} "
                       f"for tokens of shape {(B, T)} (T >= 2), got {tuple(streams.shape)}")
    return self._decode_reusing(params, cache, tokens, streams, tuple(shallow_k),
                                tuple(shallow_v))

  @functools.partial(jax.jit, static_argnums=(0,))
  def _decode_reusing(self, params, cache: DecodeCache, tokens, streams, shallow_k,
                      shallow_v):
    dec = params["decoder"]
    B, T = tokens.shape
    k = len(shallow_k)
    offsets, last = cache.lengths, cache.lengths + T - 1
    rel = dec["relpos_bias"]["rel_embedding"]
    take = lambda src, axis: jax.vmap(  # each row's T - 1 slots from its offset
        lambda s, o: jax.lax.dynamic_slice_in_dim(s, o, T - 1, axis=axis - 1))(src, offsets)
    axes = DecodeCache.POSITION_AXES
    rows = [_row_writes(dec[f"layers_{i}"]) for i in range(k)]
    self_kv = [(_write_rows(cache.self_k[i], take(shallow_k[i], axes["self_k"]), offsets,
                            axes["self_k"], rows[i]),
                _write_rows(cache.self_v[i], take(shallow_v[i], axes["self_v"]), offsets,
                            axes["self_v"], rows[i])) for i in range(k)]
    x = self._embed(params, tokens[:, T - 1:])  # the last token: layers 0 .. k - 1
    x, x_prev, new_k, new_v, _ = self._decoder_layers(
        dec, cache, range(k), x, x, last,
        self.self_attention_geometry(self._get(rel, x), last, 1, cache.max_length), self_kv,
        rowwise=_reuse_rowwise_self_attention())
    x = jnp.concatenate([streams.astype(x.dtype), x], axis=1)  # all T: layers k ..
    x, x_prev, deep_k, deep_v, _ = self._decoder_layers(
        dec, cache, range(k, self.config.num_decoder_layers), x, x_prev, offsets,
        self.self_attention_geometry(self._get(rel, x), offsets, T, cache.max_length))
    return self._decoded(params, cache.replace(self_k=tuple(new_k + deep_k),
                                               self_v=tuple(new_v + deep_v),
                                               lengths=offsets + T), x, x_prev)

  def logits_from_hidden(self, params, x_BTD):
    """The LM head: final decoder states [B, T, D] -> float32 logits [B, T, V]."""
    return self._logits(self._get(self._head_kernel(params), x_BTD), x_BTD)

  def _head_kernel(self, params):
    """The LM head's kernel: the token embedding [V, D] or logits_dense [D, V]."""
    if self.config.logits_via_embedding:
      return params["token_embedder"]["embedding"]
    return params["decoder"]["logits_dense"]["kernel"]

  def _logits(self, kernel, x_BTD):
    c = self.config
    if c.logits_via_embedding:
      if isinstance(x_BTD, _Normed):
        x_BTD = x_BTD.value()
      logits = jnp.einsum("BTD,VD->BTV", x_BTD, kernel.astype(c.dtype)) / math.sqrt(c.emb_dim)
    else:
      logits = self._dense(x_BTD, kernel)
    return logits.astype(_at_least_f32(c.dtype))

  # ---------------------------------------------------------------- decoding layout
  def decode_params(self, params: Params) -> Params:
    """`params` laid out for decoding on this backend; the same values.

    On XLA:CPU with float32 weights, every encoder and decoder kernel [I, O] of at least
    `packed_min_elements` elements (default `cpu_matmul.MIN_PACKED_ELEMENTS`) becomes a
    `cpu_matmul.PackedKernel` (stored as `kernel_weights` says), which the model multiplies
    by with the weight-streaming CPU kernel (a verify call of gamma + 1 tokens then reads
    each weight once, as a single-token step does); smaller matrices keep XLA's dot.
    Elsewhere, when no kernel is that large, when the kernel is unavailable, or for
    streamed parameters, `params` is returned as is. The packed copy is made once per
    parameter tree, `kernel_weights` and threshold (cached by the leaves' identity), so
    decoders call this per call.
    """
    threshold = (cpu_matmul.MIN_PACKED_ELEMENTS if self.packed_min_elements is None
                 else self.packed_min_elements)
    if (self.stream_params or self.config.dtype != jnp.float32
        or _largest_kernel_elements(self.config) < threshold
        or _PACKED.made(params)
        or not cpu_matmul.available()):
      return params
    return _PACKED.get(params, functools.partial(self._pack, threshold=threshold),
                       tag=(self._weights_request(), self._setup_request(), threshold))

  def _weights_request(self) -> str:
    """`kernel_weights` with 'bfloat16_dot_if_supported' decided for this CPU."""
    return _if_supported(self.kernel_weights, "auto")

  def _setup_request(self) -> str:
    """`setup_kernel_weights` with 'bfloat16_dot_if_supported' decided for this CPU (so a
    tree is packed once per setting that differs here)."""
    return _if_supported(self.setup_kernel_weights, "same")

  def _pack(self, params, threshold: int):
    requested = (self._weights_request(), self._setup_request())
    if "auto" in requested:  # bfloat16 when every packed weight is a bfloat16 value
      auto = "bfloat16" if bool(_kernels_bfloat16_exact(params)) else "float32"
    weights, setup = (auto if w == "auto" else w for w in requested)
    setup = weights if setup == "same" else setup
    for name, w in (("kernel_weights", weights), ("setup_kernel_weights", setup)):
      if w == "bfloat16_dot" and not cpu_matmul.has_bfloat16_dot():
        info = cpu_matmul.cpu_info()
        raise ValueError(f"T5.{name}='bfloat16_dot' needs a CPU with AVX512-BF16; this one "
                         f"({info['model']}) has {', '.join(info['features'])}")
    cpu_matmul.note_packed(weights)
    if setup != weights:
      cpu_matmul.note_packed(f"{setup} (set-up)")
    return _pack_kernels(params, threshold=threshold, weights=weights, setup_weights=setup)

  # ---------------------------------------------------------------- teacher forcing
  def forward(self, params: Params, encoder_tokens, decoder_input_tokens) -> jax.Array:
    """Teacher-forced logits [B, T, V] float32 (decoder inputs start with BOS = 0)."""
    encoder_tokens = _check_tokens(encoder_tokens, "encoder_tokens", self.config.vocab_size)
    decoder_input_tokens = _check_tokens(decoder_input_tokens, "decoder_input_tokens",
                                         self.config.vocab_size)
    if encoder_tokens.shape[0] != decoder_input_tokens.shape[0]:
      raise ValueError(f"batch mismatch: encoder_tokens {encoder_tokens.shape} vs "
                       f"decoder_input_tokens {decoder_input_tokens.shape}")
    return self._forward(params, encoder_tokens, decoder_input_tokens)

  @functools.partial(jax.jit, static_argnums=0)
  def _forward(self, params, encoder_tokens, decoder_input_tokens):
    encoded = self._encode(params, encoder_tokens)
    cache = self._init_cache(params, encoded, decoder_input_tokens.shape[1])
    return self._decode(params, cache, decoder_input_tokens).logits


_PACKED = cpu_matmul.PackCache(size=8)  # a target, drafts and heads decoded side by side


@functools.lru_cache(maxsize=None)
def _largest_kernel_elements(config: T5Config) -> int:
  """Elements of the model's largest 2-D kernel under encoder/ or decoder/."""
  return max(int(np.prod(shape)) for path, (shape, _, _) in T5(config)._param_specs().items()
             if path.split("/")[0] in ("encoder", "decoder") and len(shape) == 2)


# Projections of one input that `decode_params` joins into one packed kernel (their
# columns side by side): the kernel computes every column alike, so a joined product gives
# the separate products' values bit for bit, in one call instead of two or three (measured
# on the 2-core CPU: q/k/v of 192 x 192 each in 0.63x the time of three calls, of 512 x
# 384 in 0.73x at 1 row).
JOINED = {("query", "key", "value"): "qkv_joined", ("key", "value"): "kv_joined"}
JOINED_QKV, JOINED_KV = JOINED[("query", "key", "value")], JOINED[("key", "value")]
KERNEL_WEIGHTS = cpu_matmul.WEIGHTS + ("bfloat16_dot_if_supported",)
SETUP_WEIGHTS = ("same",) + KERNEL_WEIGHTS
JOINED_MLP = "wi_joined"


def _if_supported(setting: str, otherwise: str) -> str:
  """A `kernel_weights` / `setup_kernel_weights` setting with 'bfloat16_dot_if_supported'
  decided for this CPU: 'bfloat16_dot' where it has AVX512-BF16, else `otherwise`."""
  if setting == "bfloat16_dot_if_supported":
    return "bfloat16_dot" if cpu_matmul.has_bfloat16_dot() else otherwise
  return setting


def _kernel(tree, name):
  leaf = tree.get(name, {}).get("kernel") if isinstance(tree.get(name), Mapping) else None
  return leaf if getattr(leaf, "ndim", 0) == 2 else None


@jax.jit
def _kernels_bfloat16_exact(params):
  """Whether every 2-D kernel under encoder/ and decoder/ holds bfloat16 values only (a
  checkpoint stored in bfloat16), so packing them as bfloat16 loses nothing."""
  kernels = [leaf for name in ("encoder", "decoder")
             for leaf in jax.tree_util.tree_leaves(params.get(name, {})) if leaf.ndim == 2]
  return jnp.all(jnp.stack([cpu_matmul.bfloat16_exact(k) for k in kernels]))


@functools.partial(jax.jit, static_argnames=("threshold", "weights", "setup_weights"))
def _pack_kernels(params, threshold: int, weights: str = "float32",
                  setup_weights: str | None = None):
  """Every 2-D `kernel` under encoder/ and decoder/ with >= `threshold` elements as a
  PackedKernel (`weights`: float32, bfloat16, int8 or bfloat16_dot; the encoder's and the
  cross-attention key/value kernels, which only the set-up multiplies by, as
  `setup_weights`, default `weights`), the others as they are (so a packed tree packs to
  itself); an attention block's query/key/value (cross-attention's key/value) and an MLP's
  gated input kernels are joined into one packed kernel (`JOINED`, `JOINED_MLP`) when that
  is large enough, replacing them."""
  setup_weights = setup_weights or weights

  def pack(kernel, w):
    return cpu_matmul.pack(kernel.astype(jnp.float32), w)

  def join(tree, names, joined, w):
    kernels = [_kernel(tree, n) for n in names]
    if any(k is None for k in kernels) or sum(k.size for k in kernels) < threshold:
      return tree
    out = {k: v for k, v in tree.items() if k not in names}
    out[joined] = {"kernel": pack(jnp.concatenate(kernels, axis=1), w)}
    return out

  def visit(tree, w, name=None):
    if not isinstance(tree, Mapping):
      if name == "kernel" and getattr(tree, "ndim", 0) == 2 and tree.size >= threshold:
        return pack(tree, w)
      return tree
    if name in ("attention", "self_attention"):
      tree = join(tree, ("query", "key", "value"), JOINED[("query", "key", "value")], w)
    elif name == "encoder_decoder_attention":
      kv = JOINED[("key", "value")]
      tree = join(tree, ("key", "value"), kv, setup_weights)
      return {k: visit(v, setup_weights if k in ("key", "value", kv) else w, k)
              for k, v in tree.items()}
    elif name == "mlp" and "wi_0" in tree:
      tree = join(tree, tuple(sorted(k for k in tree if k.startswith("wi_"))), JOINED_MLP, w)
    return {k: visit(v, w, k) for k, v in tree.items()}

  layer_weights = {"encoder": setup_weights, "decoder": weights}
  return {k: visit(v, layer_weights[k]) if k in layer_weights else v for k, v in params.items()}
