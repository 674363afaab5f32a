"""The Decoder protocol: what a decoding algorithm may ask of a model.

Decoding algorithms (autoregressive, speculative, tree drafts) depend on this
protocol, never on a concrete class, so a T5, an n-gram table or a
feature-level head can serve as target or drafter interchangeably.

Token ids shared by every model: PAD = BOS = 0, EOS = 1.

`decode(params, cache, tokens[B,T], *, positions=None, tree_mask=None)` appends
T new tokens at each row's cache length (cache slots lengths .. lengths+T-1)
and returns a `DecodeOutput` (logits, final hidden states, new cache):
  positions [B, T] int: the sequence position of each new token (default
      lengths + 0..T-1). In a draft tree a node sits at prefix length + depth,
      which differs from its cache slot.
  tree_mask [B, T, T] bool: which new tokens each new token may attend to
      (default causal: j <= t). A tree passes "j is t or an ancestor of t".
      Every new token always sees the whole cached prefix.
After a tree is verified, `cache.keep(start, indices, count)` keeps the
accepted path's entries in order, so the cache again holds one sequence.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import tree_util

PAD_ID = 0
BOS_ID = 0
EOS_ID = 1


def check_tokens(tokens, name: str, vocab_size: int) -> jax.Array:
  """Validates a [B, T] integer token array at the Python API boundary; int32.

  Ranks and dtypes are checked always; the id range only when the values are
  concrete (not under jit tracing), where it costs one host transfer, and
  fully addressable (a multi-host global array, of which a process holds only
  its own rows, is not checked).
  """
  return jnp.asarray(validate_tokens(tokens, name, vocab_size), jnp.int32)


def validate_tokens(tokens, name: str, vocab_size: int):
  """`check_tokens`' checks without moving anything to the device: concrete, fully
  addressable tokens come back as a numpy int32 array (read once), others (tracers,
  multi-host global arrays) as they are, checked where they can be."""
  if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
    try:
      tokens = np.asarray(tokens)
    except ValueError:  # numpy's "inhomogeneous shape": rows of different lengths
      raise ValueError(f"{name} must be a rectangular [batch, length] array of token ids; "
                       f"its rows have different lengths (pad the shorter ones with 0, the "
                       f"PAD id)") from None
  if tokens.ndim != 2:
    raise ValueError(f"{name} must have shape [batch, length], got shape {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {tokens.dtype}")
  if tokens.shape[1] < 1 or tokens.shape[0] < 1:
    raise ValueError(f"{name} must be non-empty, got shape {tokens.shape}")
  if isinstance(tokens, jax.core.Tracer) or not getattr(tokens, "is_fully_addressable", True):
    return tokens
  arr = np.asarray(tokens)
  lo, hi = int(arr.min()), int(arr.max())
  if lo < 0 or hi >= vocab_size:
    raise ValueError(f"{name} has token ids in [{lo}, {hi}], outside the vocabulary "
                     f"[0, {vocab_size})")
  return arr.astype(np.int32, copy=False)


def packing_index(tokens) -> np.ndarray | None:
  """The flat positions b * S + s of the non-PAD tokens of concrete tokens [B, S], padded
  with B * S to a power of two P >= 8 (one compile per P), for encoders that run packed
  (`supports_packed_encoding`, e.g. `T5.encode(packed_index=)`); None when P would not be
  smaller than B * S (nothing to save: one row trimmed of its padding, or rows of equal
  length)."""
  tokens = np.asarray(tokens)
  B, S = tokens.shape
  flat = np.flatnonzero(tokens.reshape(-1) != PAD_ID)
  P = max(8, 1 << max(flat.size - 1, 0).bit_length())
  if P >= B * S:
    return None
  return np.concatenate([flat, np.full(P - flat.size, B * S)]).astype(np.int32)


def decoding_params(model, params):
  """`params` in the layout `model` decodes fastest with on this backend (its
  `decode_params`, e.g. T5's packed CPU kernels), or `params` itself for models
  without one. The values are unchanged; call it once per decode call, outside jit."""
  fn = getattr(model, "decode_params", None)
  return params if fn is None or params is None else fn(params)


def check_tree_args(tokens: jax.Array, positions, tree_mask):
  """Validates decode's optional positions [B,T] and tree_mask [B,T,T]; returns them as arrays."""
  B, T = tokens.shape
  if positions is not None:
    positions = jnp.asarray(positions)
    if positions.shape != (B, T) or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"positions must be an integer array of shape {(B, T)}, got "
                       f"{positions.dtype} {positions.shape}")
    positions = positions.astype(jnp.int32)
  if tree_mask is not None:
    tree_mask = jnp.asarray(tree_mask)
    if tree_mask.shape != (B, T, T) or tree_mask.dtype != jnp.bool_:
      raise ValueError(f"tree_mask must be a bool array of shape {(B, T, T)}, got "
                       f"{tree_mask.dtype} {tree_mask.shape}")
  return positions, tree_mask


@flax.struct.dataclass
class DecodeOutput:
  """What `decode` returns.

  logits: [B, T, V] float32 next-token logits after each new token.
  cache:  the cache with the T tokens appended (lengths + T).
  hidden: [B, T, D] the final decoder states the logits are read from (after
          the last norm), or None for models without features (n-gram tables).
  features: [B, T, L * D] the residual streams after the decoder layers a caller asked
          for (`T5.decode(layers=...)`, in that order, concatenated), or None.
  """
  logits: jax.Array
  cache: Any
  hidden: Any = None
  features: Any = None


@runtime_checkable
class Cache(Protocol):
  """A per-row KV (or state) cache. `lengths` [B] int32 = tokens consumed per row."""
  lengths: jax.Array

  @property
  def max_length(self) -> int: ...

  def rewind(self, lengths: jax.Array) -> "Cache":
    """Sets each row's length; entries beyond it are ignored and later overwritten."""

  def keep(self, start: jax.Array, indices: jax.Array, count: jax.Array) -> "Cache":
    """Keeps entries start+indices[:, :count] as slots start..start+count-1; lengths = start+count."""

  def logical_axes(self) -> Any:
    """The cache's pytree with a tuple of logical axis names at each leaf."""


class LengthCache:
  """Mixin for flax.struct caches whose rewind only moves the per-row `lengths` [B].

  Entries beyond a row's length stay in place; attention (or the lookup) never
  reads them and later writes overwrite them, so a rewind is O(1). Subclasses
  name their per-position arrays (batch on axis 0, cache position on axis 1,
  or on the axis `POSITION_AXES` gives that field) in `POSITION_FIELDS`;
  `keep` gathers those.
  """

  POSITION_FIELDS: tuple[str, ...] = ()
  POSITION_AXES: Mapping[str, int] = {}

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  def rewind(self, lengths):
    """Sets each row's length."""
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != self.lengths.shape:
      raise ValueError(f"rewind lengths must have shape {self.lengths.shape}, "
                       f"got {lengths.shape}")
    return self.replace(lengths=lengths)

  def keep(self, start, indices, count):
    """Keeps a subset of the entries written after `start`, in order (a tree's accepted path).

    start [B]: each row's length before the last write; indices [B, K]: which of
    the entries written at slots start .. start + T - 1 to keep (0-based, into
    that write), in the order to keep them; count [B] <= K: how many of them.
    Slot start + i then holds entry start + indices[i]; lengths = start + count.
    """
    start = jnp.asarray(start, jnp.int32)
    indices = jnp.asarray(indices, jnp.int32)
    count = jnp.asarray(count, jnp.int32)
    B = self.batch_size
    if start.shape != (B,) or count.shape != (B,) or indices.ndim != 2 \
        or indices.shape[0] != B:
      raise ValueError(f"keep needs start [{B}], indices [{B}, K] and count [{B}], got "
                       f"{start.shape}, {indices.shape}, {count.shape}")
    slots = start[:, None] + indices  # [B, K]

    def move(x, axis):
      if x is None:
        return x
      idx = slots.reshape((B,) + (1,) * (axis - 1) + (slots.shape[1],)
                          + (1,) * (x.ndim - axis - 1))
      picked = jnp.take_along_axis(x, jnp.minimum(idx, x.shape[axis] - 1), axis=axis)
      write = lambda row, new, at: jax.lax.dynamic_update_slice_in_dim(row, new, at,
                                                                       axis=axis - 1)
      return jax.vmap(write)(x, picked, start)

    moved = {name: jax.tree_util.tree_map(
                 functools.partial(move, axis=self.POSITION_AXES.get(name, 1)),
                 getattr(self, name))
             for name in self.POSITION_FIELDS}
    return self.replace(lengths=start + count, **moved)

  def check_append(self, tokens) -> None:
    """Raises ValueError unless tokens [B, T] fit after every row's current length.

    The per-row overflow check needs concrete lengths, so it is skipped under jit
    tracing (the decoding loops size their caches so it cannot happen there).
    """
    B, T = tokens.shape
    if B != self.batch_size:
      raise ValueError(f"tokens batch {B} != cache batch {self.batch_size}")
    if T > self.max_length:
      raise ValueError(f"cannot decode {T} tokens into a cache of length {self.max_length}")
    if not isinstance(self.lengths, jax.core.Tracer):
      longest = int(jnp.max(self.lengths))
      if longest + T > self.max_length:
        raise ValueError(f"decoding {T} tokens at length {longest} overflows the cache "
                         f"(max_decode_len {self.max_length})")


@runtime_checkable
class Decoder(Protocol):
  """A conditional next-token model with an explicit, rewindable cache.

  Implementations must be hashable (they are static arguments of jitted loops)
  and their methods pure functions of (params, inputs).
  """

  @property
  def vocab_size(self) -> int: ...

  def encode(self, params: Any, encoder_tokens: jax.Array) -> Any:
    """Per-example conditioning computed once (e.g. encoder states); may have `logical_axes()`."""

  def init_cache(self, params: Any, encoded: Any, max_decode_len: int) -> Cache:
    """An empty cache with room for `max_decode_len` decoder tokens per row."""

  def decode(self, params: Any, cache: Cache, tokens: jax.Array, *, positions=None,
             tree_mask=None) -> DecodeOutput:
    """Appends tokens [B, T] at each row's length (see the module doc)."""


class ParamSpecs:
  """Parameters described by `_param_specs()`: {"a/b/c": (shape, logical axes, initializer)}.

  Gives the parameter tree's random init (in `config.dtype`), its shapes without
  allocating, its logical axis names and its parameter count, the same way for every
  model that describes its parameters so (T5, the EAGLE head).
  """

  def _param_specs(self) -> dict:
    raise NotImplementedError

  def init(self, rng: jax.Array) -> dict:
    """Random parameters from each spec's initializer, in `config.dtype`."""
    specs = self._param_specs()
    keys = jax.random.split(rng, len(specs))
    flat = {path: fn(k, shape, jnp.float32).astype(self.config.dtype)
            for k, (path, (shape, _, fn)) in zip(keys, sorted(specs.items()))}
    return tree_util.unflatten(flat)

  def param_shapes(self) -> dict:
    """Parameter tree of jax.ShapeDtypeStruct, without allocating anything."""
    return jax.eval_shape(self.init, jax.random.PRNGKey(0))

  def logical_axes(self) -> dict:
    """Same tree as the parameters, each leaf a tuple of logical axis names."""
    return tree_util.unflatten({p: axes for p, (_, axes, _) in self._param_specs().items()})

  def num_params(self) -> int:
    return sum(int(np.prod(s)) for s, _, _ in self._param_specs().values())

  def check_param_names(self, params, what: str, hint: str = "") -> None:
    """Raises ValueError naming `what` unless `params` has exactly the specs' names and
    shapes: how many are missing, not in the model or of another shape, an example of each,
    then `hint`."""
    want = {p: tuple(s) for p, (s, _, _) in self._param_specs().items()}
    got = {p: tuple(np.shape(v)) for p, v in tree_util.flatten(params).items()}
    if want == got:
      return
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    shapes = sorted(p for p in set(want) & set(got) if want[p] != got[p])
    parts = [f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
             f"{len(extra)} not in the model (e.g. {extra[0]})" if extra else "",
             f"{len(shapes)} of another shape (e.g. {shapes[0]}: {got[shapes[0]]}, the "
             f"model's {want[shapes[0]]})" if shapes else ""]
    raise ValueError(f"{what} params do not match its config ({type(self).__name__}, "
                     f"{self.num_params():,} parameters): " + "; ".join(p for p in parts if p)
                     + hint)


def on_cpu_unless_set(value: bool | None, name: str) -> bool:
  """A trace-time switch's value: `value` when set (True or False), else whether JAX's
  default backend is the CPU (switches for XLA:CPU's sake, e.g.
  `t5.ROWWISE_SELF_ATTENTION`). ValueError naming `name` for anything else."""
  if value is None:
    return jax.default_backend() == "cpu"
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be None, True or False, got {value!r}")
  return value
