"""The one runner of every decoding algorithm.

Input checks, per-row PRNG keys (rng, row id, step), the unsharded and the
sharded jit, sharding constraints of caches and loop state live here; an
`Algorithm` (a small frozen, hashable dataclass) holds only its loop. Adding an
algorithm is one file with a subclass and its registration line:

  @registry.algorithm("my_algo")
  @dataclasses.dataclass(frozen=True)
  class MyAlgo(runner.Algorithm):
    needs_draft = True
    def decode(self, ctx): ...          # the loop, inside jit
    def init_stats(self, batch): ...    # its named counters

and `decoding.run(MyAlgo(...), target, params, tokens, draft=..., ...)` runs it,
unsharded or on a mesh, from Python, gin or the experiment layer.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import compile_options, partitioning
from spec_decode.configurable import is_int  # noqa: F401  (also imported from here)
from spec_decode.decoding import footprint
from spec_decode.decoding.sampling import Sampling
from spec_decode.decoding.types import DecodeResult, DecodeStats
from spec_decode.models import base, offload


def row_keys(rng: jax.Array, row_ids: jax.Array, step: jax.Array) -> jax.Array:
  """[B] keys, one per row, each a function of (rng, row id, step) only.

  A row's randomness therefore never depends on its batch position or on its
  neighbours; pass the same `row_ids` to decode a row alone and in a batch. step: a
  scalar, or [B], each row's own step (the decoders pass the row's own count of loop
  iterations, so a row that enters a loop late, `refilling_loop`, draws what it would draw
  alone).
  """
  steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), jnp.shape(row_ids))
  return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(row_ids,
                                                                                  steps)


def nonfinite_rows(logits: jax.Array) -> jax.Array:
  """[B] bool: rows of logits [B, ..., V] holding a NaN or an infinity anywhere (a
  diverged or badly converted model: its argmax is then index 0, PAD, silently). The
  decoders count such calls per row (the `nonfinite_calls` counter) so runs can say so."""
  return ~jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A decoding algorithm: its settings (hashable, jit-static) and its loop.

  needs_draft: whether `run` must be given a draft model.
  drafter: what proposes tokens (a `Drafter`; None: the algorithm drafts none).
  gamma: tokens drafted per target call (None: the algorithm drafts none).
  compact_batch: whether the loop shrinks its batch as rows finish (unsharded runs only).
  Subclasses make drafter, gamma and compact_batch dataclass fields where they have them.
  max_proposal: K, the most tokens one target call verifies beyond the first (None: one
  token per call).
  decode(ctx): the whole decode inside jit -> DecodeResult (see `LoopContext`).
  init_stats(batch): its named per-row counters, zero.
  cost_model(...): the speedup its cost model predicts, or None when it has none.
  """
  needs_draft: ClassVar[bool] = False
  drafter = None
  gamma = None
  compact_batch = False

  @property
  def max_proposal(self) -> int | None:
    return None

  def check_models(self, target, draft) -> None:
    """Raises ValueError when the models cannot serve this algorithm."""

  def cache_room(self, max_decode_len: int) -> int:
    """Cache slots each model needs for `max_decode_len` output tokens."""
    return max_decode_len

  def init_stats(self, batch_size: int) -> DecodeStats:
    raise NotImplementedError(f"{type(self).__name__} declares no counters")

  def decode(self, ctx: "LoopContext") -> DecodeResult:
    """The whole decode inside jit; by default `compacting_loop` over `loop_parts`."""
    parts = self.loop_parts(ctx)
    return parts.finish(compacting_loop(
        parts.ctx, parts.init, rows_of=parts.rows_of, with_rows=parts.with_rows,
        result_of=parts.result_of, done_of=parts.done_of, make_body=parts.make_body,
        cond=parts.cond, compact=self.compact_batch))

  def loop_parts(self, ctx: "LoopContext") -> "LoopParts":
    """The loop's pieces for the rows of `ctx` (see `LoopParts`)."""
    raise NotImplementedError(f"{type(self).__name__} has no loop")

  def check_refill(self) -> None:
    """Raises ValueError when this algorithm cannot run under `refilling_loop`."""
    if type(self).loop_parts is Algorithm.loop_parts:
      raise ValueError(f"{type(self).__name__} does not describe its loop (loop_parts), so it "
                       "cannot refill its batch")
    if self.compact_batch:
      raise ValueError("refill_batch and compact_batch=True exclude each other (refilling "
                       "keeps the batch full)")
    pending = [self.drafter]
    while pending:  # the drafter and any drafter it wraps (a fallback, a base)
      drafter = pending.pop()
      if drafter is None:
        continue
      if not drafter.refillable:
        raise ValueError(f"{type(drafter).__name__} branches on the loop's shared iteration "
                         "count, so its batch cannot be refilled (refill_batch); decode in "
                         "batches")
      if dataclasses.is_dataclass(drafter):
        pending += [getattr(drafter, f.name) for f in dataclasses.fields(drafter)
                    if hasattr(getattr(drafter, f.name), "refillable")]

  def cost_model(self, *, alpha: float, draft_cost: float, verify_ratio: float,
                 counters=None) -> dict[str, Any] | None:
    """Predicted speedups over autoregressive decoding, or None (no model): see
    `Speculative.cost_model`."""
    return None


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """What an algorithm's loop sees inside jit (models, inputs, layout helpers).

  target, draft: the models (draft None when the algorithm needs none) and
  their params; encoder_tokens [B, S], draft_encoder_tokens [B, S'];
  rng, row_ids [B]; max_decode_len L; sampling. With a mesh, `constrain_*`
  lay tensors out by their logical axes (the target by `rules`, the draft by
  `draft_rules`); without one they are the identity. packed_index /
  draft_packed_index [P]: the encoders run on the real tokens only (`run`'s
  pack_inputs, `base.packing_index`), or None.
  """
  target: Any
  target_params: Any
  draft: Any
  draft_params: Any
  encoder_tokens: jax.Array
  draft_encoder_tokens: Any
  rng: jax.Array
  row_ids: jax.Array
  max_decode_len: int
  sampling: Sampling
  mesh: Any = None
  rules: Any = None
  draft_rules: Any = None
  target_encoded: Any = None
  packed_index: Any = None
  draft_packed_index: Any = None

  @property
  def batch_size(self) -> int:
    return self.encoder_tokens.shape[0]

  def _model(self, role: str):
    if role == "target":
      return self.target, self.target_params, self.encoder_tokens, self.rules
    if role == "draft":
      return self.draft, self.draft_params, self.draft_encoder_tokens, self.draft_rules
    raise ValueError(f"role must be 'target' or 'draft', got {role!r}")

  def encode(self, role: str):
    """The role's encoder output (the target's is computed once: see `with_target_encoded`)."""
    if role == "target" and self.target_encoded is not None:
      return self.target_encoded
    model, params, tokens, rules = self._model(role)
    index = self.packed_index if role == "target" else self.draft_packed_index
    encoded = (model.encode(params, tokens) if index is None
               else model.encode(params, tokens, packed_index=index))
    return partitioning.constrain(encoded, partitioning.encoder_output_axes(encoded),
                                  self.mesh, rules)

  def with_target_encoded(self) -> "LoopContext":
    """This context with the target's encoder output computed once and kept in
    `target_encoded`, for loops whose drafter also reads it (a feature-level head
    cross-attends to the target's encoder states)."""
    return dataclasses.replace(self, target_encoded=self.encode("target"))

  def start_cache(self, role: str, room: int):
    """Encodes the role's inputs (once) and returns its empty cache of `room` slots."""
    model, params, _, _ = self._model(role)
    return self.constrain_cache(model.init_cache(params, self.encode(role), room), role)

  def constrain_cache(self, cache, role: str):
    model, _, _, rules = self._model(role)
    return partitioning.constrain_cache(cache, model, self.mesh, rules)

  def constrain_batch(self, tree):
    return partitioning.constrain_batch(tree, self.mesh, self.rules)

  def keys(self, step) -> jax.Array:
    """[B] per-row keys of loop step `step`."""
    return row_keys(self.rng, self.row_ids, step)

  def take_rows(self, rows: jax.Array) -> "LoopContext":
    """This context for the batch rows `rows` [B'] only (their inputs, ids and encodings),
    for loops that shrink their batch as rows finish (`compacting_loop`)."""
    take = lambda x: None if x is None else take_rows(x, rows)
    encoded = self.target_encoded
    if encoded is not None and getattr(encoded, "packed_index", None) is not None:
      encoded = encoded.replace(packed_index=None)  # positions of the old batch
    return dataclasses.replace(
        self, encoder_tokens=take(self.encoder_tokens),
        draft_encoder_tokens=take(self.draft_encoder_tokens), row_ids=take(self.row_ids),
        target_encoded=take(encoded), packed_index=None, draft_packed_index=None)


def take_rows(tree, rows: jax.Array):
  """Every leaf of `tree` (batch on axis 0) at batch rows `rows`."""
  return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), tree)


@dataclasses.dataclass(frozen=True)
class LoopParts:
  """An algorithm's loop in pieces, for `compacting_loop` and `refilling_loop`.

  ctx: the context the loop runs in (the algorithm may have added to it, e.g. the
  target's encoder output); init: the loop state at its batch; rows_of(state) -> its
  per-row part (every leaf batch first), with_rows(state, part) -> state with that part;
  result_of(state) -> the per-row results (batch first); done_of(state) -> [B] bool;
  make_body(ctx) -> the loop body for a context's rows; cond(state) -> an extra loop
  condition or None; finish(results) -> the DecodeResult of result_of's values.
  """
  ctx: Any
  init: Any
  rows_of: Any
  with_rows: Any
  result_of: Any
  done_of: Any
  make_body: Any
  finish: Any
  cond: Any = None


# LoopContext fields that hold one entry per batch row, and move with a row.
_ROW_FIELDS = ("encoder_tokens", "draft_encoder_tokens", "row_ids", "target_encoded")


def _check_batch_first(tree, B: int, what: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if leaf.ndim < 1 or leaf.shape[0] != B:
      raise ValueError(f"{what} needs every per-row loop state leaf batch first; "
                       f"{jax.tree_util.keystr(path)} has shape {leaf.shape} at batch {B}")


def chunk_rows(n: int, batch_size: int) -> np.ndarray:
  """[C, batch_size] the rows of a refilling loop's chunks: chunk c holds rows
  c * batch_size .. c * batch_size + batch_size - 1, the last one padded with row n - 1."""
  C = -(-n // batch_size)
  return np.minimum(np.arange(C * batch_size).reshape(C, batch_size), n - 1).astype(np.int32)


def chunk_packing_index(model, tokens, batch_size: int) -> np.ndarray | None:
  """[C, P]: `pack_index` of each chunk of concrete tokens [N, S] (`chunk_rows`), padded
  with the chunk's own sentinel to one P so every chunk's encode is one compiled shape;
  None when the model does not encode packed or some chunk would not be packed."""
  if tokens is None or isinstance(tokens, jax.core.Tracer) \
      or not getattr(tokens, "is_fully_addressable", True):
    return None
  tokens = np.asarray(tokens)
  index = [pack_index(model, tokens[rows]) for rows in chunk_rows(len(tokens), batch_size)]
  if any(i is None for i in index):
    return None
  P, size = max(i.size for i in index), batch_size * tokens.shape[1]
  return np.stack([np.pad(i, (0, P - i.size), constant_values=size) for i in index])


def refilling_loop(pool: "LoopContext", batch_size: int, parts_of) -> Any:
  """Decodes every row of `pool` (N examples) in a loop of `batch_size` slots, inside one jit:
  when a slot's row finishes, its results are written out at the row's index and the next
  example takes the slot inside the loop, so the batch stays full until the examples run
  out instead of computing finished rows until its slowest one is done.

  The entering rows are prepared a chunk at a time (`chunk_rows`): the loop state of the
  next batch_size examples (their encoder outputs, caches and drafter states, the
  encoders run packed with the chunk's `pool.packed_index` row where the pool has one) is
  built in one call and waits beside the slots; a finished slot takes the next of its
  rows, and the chunk after it is built when it is used up. So encoding costs what it
  costs in plain batches, and between two finishes the loop runs the algorithm's own
  body with no branch.

  A row's keys come from (rng, its row id, its own loop step) and rows never mix, so each
  row's output is what decoding it alone gives (greedy and sampled alike). parts_of(ctx)
  -> the algorithm's `LoopParts` for a context's rows. Returns finish(results at [N]).
  """
  N = pool.batch_size
  B = min(batch_size, N)
  chunks = jnp.asarray(chunk_rows(N, B))
  packed = pool.packed_index, pool.draft_packed_index

  def prepare(c):
    """LoopParts of chunk c's rows (c clipped to the last chunk)."""
    c = jnp.minimum(c, chunks.shape[0] - 1)
    ctx = pool.take_rows(chunks[c])
    return parts_of(dataclasses.replace(
        ctx, packed_index=None if packed[0] is None else packed[0][c],
        draft_packed_index=None if packed[1] is None else packed[1][c]))

  parts = prepare(0)
  ctx0, state = parts.ctx, parts.init
  _check_batch_first(parts.rows_of(state), B, "refilling a batch")
  fields = [f for f in _ROW_FIELDS if getattr(ctx0, f) is not None]
  row_arrays = lambda ctx: {f: _unpacked(getattr(ctx, f)) for f in fields}
  waiting = lambda p: (parts.rows_of(p.init), row_arrays(p.ctx))
  outs = jax.tree.map(lambda x: jnp.zeros((N,) + x.shape[1:], x.dtype), parts.result_of(state))

  def slot_ctx(rows):
    return dataclasses.replace(ctx0, packed_index=None, draft_packed_index=None, **rows)

  def phase(carry, first_is_all=False):
    """One chunk of entering rows: built, then given to slots as their rows finish, until
    it is used up; the last chunk's phase goes on retiring finished slots (no example is
    left) until none is live. first_is_all: the first batch held every row, so no chunk
    is built (a stand-in waits, never entered: every slot this phase settles is retired)."""
    state, rows, slot, nxt, outs = carry
    wait = (parts.rows_of(state), rows) if first_is_all else waiting(prepare(nxt // B))
    limit = jnp.minimum((nxt // B + 1) * B, N)  # rows nxt .. limit - 1 wait in this chunk
    can_settle = lambda nxt: (nxt < limit) | (nxt >= N)

    def settle_one(c):
      """The first finished slot: its results out, then the next waiting row into it or,
      with no example left, the slot retired (-1)."""
      state, rows, slot, nxt, outs, pending = c
      r = jnp.argmax(pending)
      outs = jax.tree.map(lambda o, v: o.at[slot[r]].set(v[r]), outs, parts.result_of(state))
      more = nxt < N
      k = nxt % B
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(more, n[k], o[r]), new, old)
      state = parts.with_rows(state, jax.tree.map(
          lambda f, v: f.at[r].set(v), parts.rows_of(state),
          keep(wait[0], parts.rows_of(state))))
      rows = jax.tree.map(lambda f, v: f.at[r].set(v), rows, keep(wait[1], rows))
      slot = slot.at[r].set(jnp.where(more, nxt, -1))
      return state, rows, slot, nxt + more.astype(jnp.int32), outs, pending.at[r].set(False)

    def segment(c):
      """Decode until a live slot's row finishes (a plain while loop over the algorithm's
      body, no branch per iteration), then settle finished slots while rows wait."""
      state, rows, slot, nxt, outs = c
      live = slot >= 0
      state = jax.lax.while_loop(lambda s: ~jnp.any(parts.done_of(s) & live),
                                 parts.make_body(slot_ctx(rows)), state)
      pending = parts.done_of(state) & live
      c = jax.lax.while_loop(lambda c: jnp.any(c[-1]) & can_settle(c[3]), settle_one,
                             (state, rows, slot, nxt, outs, pending))
      return c[:-1]

    return jax.lax.while_loop(lambda c: jnp.any(c[2] >= 0) & can_settle(c[3]), segment,
                              (state, rows, slot, nxt, outs))

  carry = (state, row_arrays(ctx0), jnp.arange(B, dtype=jnp.int32), jnp.int32(B), outs)
  if chunks.shape[0] == 1:
    carry = phase(carry, first_is_all=True)
  else:
    # One phase per chunk after the first, each entered with its rows waiting (nxt < N):
    # a phase ends when its chunk is used up, the last chunk's when no slot is live. The
    # algorithm's body is traced once (a separate last phase was a second copy of it).
    carry = jax.lax.while_loop(lambda c: jnp.any(c[2] >= 0), phase, carry)
  return parts.finish(carry[4])


def _unpacked(x):
  """A row field as the slots keep it: an encoder output without its packing index (the
  positions of the chunk it was built in)."""
  if getattr(x, "packed_index", None) is not None:
    return x.replace(packed_index=None)
  return x


def compaction_sizes(batch_size: int) -> tuple[int, ...]:
  """The batch sizes a compacting loop runs at: B, then halved (rounded up) down to 1."""
  sizes = [batch_size]
  while sizes[-1] > 1:
    sizes.append((sizes[-1] + 1) // 2)
  return tuple(sizes)


def compacting_loop(ctx: LoopContext, state, *, rows_of, with_rows, result_of, done_of,
                    make_body, cond=None, compact: bool):
  """`lax.while_loop` until every row is done, on a batch that shrinks as rows finish.

  Rows finish at different iterations (EOS, acceptance), and a batched loop runs until its
  slowest row is done, computing every finished row on each iteration. With `compact`,
  the loop runs at batch B until at most ceil(B / 2) rows are active, then gathers those
  rows (their state, inputs, ids and encodings: `LoopContext.take_rows`) into a batch of
  ceil(B / 2), and so on down to 1: the iterations after most rows finished cost what a
  smaller batch costs (a verify call's tokens times the batch is compute bound on CPUs).
  Each row keeps its own keys (row ids) and the loop's step count, so every row's output
  is what the uncompacted loop gives it.

  state: the loop state at batch B. rows_of(state) -> its per-row part (every leaf batch
  first), with_rows(state, part) -> state with that part replaced, result_of(state) -> the
  per-row results to return (batch first); done_of(state) -> [B'] bool; make_body(ctx) ->
  the loop body for a context (the batch of its rows); cond(state) -> bool, an extra
  condition (e.g. a step limit) and-ed with "some row is active". Returns result_of at
  batch B, in the original row order.
  """
  extra = cond or (lambda s: True)
  if not compact or ctx.batch_size == 1:
    loop_cond = lambda s: extra(s) & ~jnp.all(done_of(s))
    return result_of(jax.lax.while_loop(loop_cond, make_body(ctx), state))
  if ctx.mesh is not None:
    raise ValueError("batch compaction applies to unsharded runs only (mesh=None)")
  B = ctx.batch_size
  _check_batch_first(rows_of(state), B, "batch compaction")
  sizes = compaction_sizes(B)
  final = result_of(state)
  rows = jnp.arange(B)
  for k, size in enumerate(sizes):
    stop_at = sizes[k + 1] if k + 1 < len(sizes) else 0  # active rows the next stage holds
    state = jax.lax.while_loop(
        lambda s, n=stop_at: extra(s) & (jnp.sum(~done_of(s)) > n), make_body(ctx), state)
    # Every row's results at batch B: finished rows' are final, the others get overwritten.
    final = jax.tree.map(lambda f, v: f.at[rows].set(v), final, result_of(state))
    if k + 1 < len(sizes):
      keep = jnp.argsort(done_of(state), stable=True)[:sizes[k + 1]]  # active rows first
      state = with_rows(state, take_rows(rows_of(state), keep))
      ctx, rows = ctx.take_rows(keep), rows[keep]
  return final


@functools.lru_cache(maxsize=1)
def _greedy_key() -> jax.Array:
  """The key of greedy runs given no rng (made once: an eager PRNGKey is a device op per call)."""
  return jax.random.PRNGKey(0)


MIN_INPUT_BUCKET = 8


def input_length(tokens) -> int:
  """The encoder length a decode call runs concrete tokens [B, S] at (`run`'s trim_inputs):
  up to the last position any row fills (PAD = 0 marks padding wherever it is, so columns
  that are padding in every row change nothing but the work), rounded up to a power of two
  of at least MIN_INPUT_BUCKET, so that batches of different lengths share a few compiles;
  never more than S."""
  filled = np.flatnonzero((np.asarray(tokens) != 0).any(axis=0))
  return length_bucket(int(filled[-1]) + 1 if filled.size else 1, tokens.shape[1])


def length_bucket(n: int, width: int) -> int:
  """The encoder length inputs of up to n real tokens run at, padded to `width`."""
  return min(width, max(MIN_INPUT_BUCKET, 1 << (max(n, 1) - 1).bit_length()))


def trim_padding(tokens):
  """tokens [B, S] without the trailing columns that are padding in every row, as
  `input_length` rounds; tokens under jit tracing or spread over hosts are returned as is."""
  if tokens is None or isinstance(tokens, jax.core.Tracer) \
      or not getattr(tokens, "is_fully_addressable", True):
    return tokens
  n = input_length(tokens)
  return tokens if n == tokens.shape[1] else tokens[:, :n]


def check_rng(rng) -> None:
  """Raises ValueError unless `rng` is a JAX PRNG key: a typed key (`jax.random.key`) or raw
  uint32 key data (`jax.random.PRNGKey`), not a seed (an int would fail deep inside JAX)."""
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                            or (dtype == np.uint32 and getattr(rng, "ndim", 0) >= 1)):
    return
  what = f"{type(rng).__name__}" + (f" of dtype {dtype}" if dtype is not None else f" {rng!r}")
  raise ValueError(f"rng must be a JAX PRNG key, e.g. jax.random.PRNGKey(seed) or "
                   f"jax.random.key(seed), got {what[:80]}")


def check_inputs(model, encoder_tokens, *, max_decode_len, sampling, rng, row_ids):
  """Validates the public arguments of a decoder; returns normalized values. Concrete
  tokens come back as numpy int32 arrays (`base.validate_tokens`): they are read on the
  host once, trimmed there, and moved to the device by the decode call itself, with no
  eager device op per call (each is a dispatch, a visible share of a small model's decode)."""
  if not is_int(max_decode_len) or max_decode_len < 1:
    raise ValueError(f"max_decode_len must be a positive int, got {max_decode_len!r}")
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a decoding.Sampling, got {type(sampling).__name__}")
  encoder_tokens = base.validate_tokens(encoder_tokens, "encoder_tokens", model.vocab_size)
  B = encoder_tokens.shape[0]
  if rng is None:
    if not sampling.greedy:
      raise ValueError("rng is required when sampling with temperature > 0")
    rng = _greedy_key()
  else:
    check_rng(rng)
  if row_ids is None:
    row_ids = np.arange(B, dtype=np.int32)  # host array: no eager device op per call
  else:
    concrete = not isinstance(row_ids, jax.core.Tracer) \
        and getattr(row_ids, "is_fully_addressable", True)
    if concrete and not hasattr(row_ids, "dtype"):
      row_ids = np.asarray(row_ids)
    # (a float or bool id cast to int32 would silently give rows each other's streams)
    if row_ids.dtype == bool or not jnp.issubdtype(row_ids.dtype, jnp.integer):
      raise ValueError(f"row_ids must be integers (they key each row's random stream), got "
                       f"dtype {row_ids.dtype}")
    row_ids = np.asarray(row_ids, np.int32) if concrete else jnp.asarray(row_ids, jnp.int32)
    if row_ids.shape != (B,):
      raise ValueError(f"row_ids must have shape ({B},), got {row_ids.shape}")
  return encoder_tokens, int(max_decode_len), rng, row_ids


def check_streamed_params(role: str, model, params) -> None:
  """Raises ValueError when `model` streams its parameters from host memory
  (`stream_params`) but some of `params` are not there: jit would hold them in
  device memory, the very thing streaming avoids."""
  if not getattr(model, "stream_params", False):
    return
  off = offload.off_host_paths(params)
  if off:
    raise ValueError(f"the {role} streams its parameters from host memory (stream_params=True) "
                     f"but {len(off)} of its parameter arrays are not in host memory (e.g. "
                     f"{off[0]}); place them with spec_decode.models.offload.to_host(params)")


@functools.lru_cache(maxsize=64)
def _param_layout(model) -> tuple:
  """(tree structure, leaf shapes) of `model`'s parameters, as `jax.tree.flatten` gives them
  (models are frozen dataclasses, hashable: they are jit-static)."""
  leaves, treedef = jax.tree.flatten(model.param_shapes())
  return treedef, [tuple(x.shape) for x in leaves]


def check_params_fit(role: str, model, params) -> None:
  """Raises ValueError naming `role` unless `params` have the names and shapes `model`'s
  config describes (a model that describes its parameters, `base.ParamSpecs`): params of
  another model (the target's and the draft's swapped, another size's checkpoint) would
  otherwise fail deep inside the jitted loop with a KeyError or a shape error."""
  if not isinstance(model, base.ParamSpecs):
    return
  if params is None:
    if jax.tree.leaves(model.param_shapes()):
      raise ValueError(f"the {role} model needs its parameters: pass {role}_params= (got None)")
    return
  leaves, treedef = jax.tree.flatten(params)
  if (treedef, [tuple(getattr(x, "shape", ())) for x in leaves]) == _param_layout(model):
    return  # the common case, without building names (this runs on every decode call)
  model.check_param_names(params, f"the {role}'s", hint=(
      " (are they another model's, e.g. the target's and the draft's swapped?)"))


def _impl(target_params, draft_params, encoder_tokens, draft_encoder_tokens, rng, row_ids,
          packed=(None, None), *, algorithm, target, draft, max_decode_len, sampling, mesh=None,
          rules=None, draft_rules=None, refill_batch=None) -> DecodeResult:
  ctx = LoopContext(target=target, target_params=target_params, draft=draft,
                    draft_params=draft_params, encoder_tokens=encoder_tokens,
                    draft_encoder_tokens=draft_encoder_tokens, rng=rng, row_ids=row_ids,
                    max_decode_len=max_decode_len, sampling=sampling, mesh=mesh, rules=rules,
                    draft_rules=draft_rules, packed_index=packed[0],
                    draft_packed_index=packed[1])
  if refill_batch is not None:
    return refilling_loop(ctx, refill_batch, algorithm.loop_parts)
  return algorithm.decode(ctx)


_STATIC = ("algorithm", "target", "draft", "max_decode_len", "sampling", "refill_batch")


@functools.lru_cache(maxsize=None)
def _unsharded_jit(options: tuple[tuple[str, Any], ...]):
  return jax.jit(_impl, static_argnames=_STATIC, compiler_options=dict(options) or None)


def resolve_rules(rules, draft_rules):
  """Default layouts: the target by T5X's standard rules, the draft data-parallel."""
  rules = partitioning.standard_logical_axis_rules() if rules is None else \
      partitioning.validate_rules(rules)
  draft_rules = partitioning.data_parallel_rules(rules) if draft_rules is None else \
      partitioning.validate_rules(draft_rules)
  return rules, draft_rules


def sharded(algorithm: Algorithm, target, draft, mesh, *, batch_shape, max_decode_len: int,
            sampling: Sampling, rules=None, draft_rules=None, target_params=None,
            draft_params=None):
  """(jitted fn over the six dynamic arguments, their input shardings) on `mesh`.

  The arguments are (target_params, draft_params, encoder_tokens,
  draft_encoder_tokens, rng, row_ids); draft ones are None without a draft.
  Parameter trees may be given as arrays or shapes (for memory planning).
  """
  rules, draft_rules = resolve_rules(rules, draft_rules)
  batch = partitioning.batch_sharding(mesh, batch_shape, rules)
  in_shardings = (
      partitioning.param_shardings(target, mesh, rules, params=target_params),
      None if draft is None else partitioning.param_shardings(draft, mesh, draft_rules,
                                                              params=draft_params),
      batch, None if draft is None else batch, partitioning.replicated(mesh), batch)
  fn = partitioning.sharded_jit(_impl, in_shardings, batch, algorithm=algorithm, target=target,
                                draft=draft, max_decode_len=max_decode_len, sampling=sampling,
                                mesh=mesh, rules=rules, draft_rules=draft_rules)
  return fn, in_shardings


def pack_index(model, tokens):
  """`base.packing_index` of concrete tokens for models whose encoder runs packed
  (`supports_packed_encoding`), else None."""
  if tokens is None or not getattr(model, "supports_packed_encoding", False) \
      or isinstance(tokens, jax.core.Tracer) or not getattr(tokens, "is_fully_addressable", True):
    return None
  return base.packing_index(tokens)


def compiled_shape(model, tokens) -> tuple[int, int | None]:
  """What of concrete tokens [B, S] selects an unsharded decode call's compiled program
  beyond B: the trimmed input length and the packed length (None: not packed). Callers
  that time decodes make one untimed call per distinct value first."""
  trimmed = trim_padding(np.asarray(tokens))
  index = pack_index(model, trimmed)
  return trimmed.shape[1], None if index is None else int(index.size)


def _before_compile(algorithm, target, draft, max_decode_len, sampling, tokens, draft_tokens,
                    rest, devices) -> None:
  """Once per distinct decode program: room among the process's memory maps, and a
  refusal (`footprint.DecodeMemoryError`) of a shape that cannot fit in `devices`' memory."""
  shape = lambda t: None if t is None else tuple(t.shape)
  key = (algorithm, target, draft, max_decode_len, sampling, shape(tokens), shape(draft_tokens),
         rest)
  try:
    hash(key)
  except TypeError:  # e.g. partitioning rules given as lists
    key = repr(key)
  footprint.before_compile(key, lambda: footprint.check_fits(
      algorithm, target, draft, batch=tokens.shape[0], input_len=tokens.shape[1],
      draft_input_len=None if draft_tokens is None else draft_tokens.shape[1],
      max_decode_len=max_decode_len, devices=devices))


def clamp_gamma(algorithm: Algorithm, max_decode_len: int) -> Algorithm:
  """`algorithm` with its gamma at most max_decode_len, with a warning when that changes it.

  A row never keeps more than max_decode_len tokens, so drafting more per call only sizes
  the cache and the verify call for tokens that are always cut; the outputs (their
  distribution) are the same. An algorithm whose gamma cannot be replaced
  (`dataclasses.replace`) is refused instead.
  """
  gamma = algorithm.gamma
  if not is_int(gamma) or gamma <= max_decode_len:
    return algorithm
  text = (f"gamma {gamma} is larger than max_decode_len {max_decode_len}, the most tokens a "
          f"row decodes")
  if not dataclasses.is_dataclass(algorithm):
    raise ValueError(f"{text}: use gamma <= {max_decode_len}")
  warnings.warn(f"{text}: decoding with gamma {max_decode_len}", stacklevel=3)
  return dataclasses.replace(algorithm, gamma=int(max_decode_len))


def run(algorithm: Algorithm, target, target_params, encoder_tokens, *, draft=None,
        draft_params=None, draft_encoder_tokens=None, max_decode_len: int,
        sampling: Sampling = Sampling(), rng=None, row_ids=None, mesh=None, rules=None,
        draft_rules=None, compiler_options=None, trim_inputs: bool = True,
        pack_inputs: bool = True, refill_batch: int | None = None) -> DecodeResult:
  """Decodes `encoder_tokens` [B, S] with `algorithm`; see `decoding.autoregressive`.

  draft / draft_params: the drafter model when the algorithm needs one, with
  its own draft_encoder_tokens (default encoder_tokens). mesh: run sharded
  (target by `rules`, default T5X's; draft by `draft_rules`, default
  data-parallel: replicated parameters, batch sharded); outputs equal the
  unsharded ones. compiler_options: XLA options for this executable (unsharded
  runs), e.g. {"xla_cpu_use_onednn": True}; None (default): the project's
  defaults for the backend (`spec_decode.compile_options`; {} gives XLA's own);
  each distinct set compiles once. trim_inputs (default, unsharded runs): the encoders run
  on the inputs without the trailing columns that are padding in every row, rounded up to a
  power of two (`input_length`; a task padded to 512 tokens whose batch holds 40 encodes
  64). Padding is masked everywhere, so this changes only the work, and each distinct
  length compiles once. pack_inputs (default, unsharded runs): rows of different lengths
  are encoded packed, the encoders' projections and MLPs running on the real tokens only
  (`base.packing_index`, rounded up to a power of two; a batch of 8 inputs of 6-23 tokens
  padded to 32 encodes ~128 positions instead of 256); the same states, less work.

  refill_batch (unsharded runs): decode all B rows of `encoder_tokens` (a dataset) in a loop
  of refill_batch slots, each finished row's slot taken by the next row inside the loop
  (`refilling_loop`): the slots stay busy instead of a batch waiting for its slowest row.
  Each row's output is what decoding it alone with the same row id gives; results come
  back for all B rows in their order. Entering rows are encoded refill_batch at a time
  (packed as pack_inputs says), and wait beside the slots: the loop holds the state of
  2 x refill_batch rows. Not with compact_batch, nor with drafters that are not
  `refillable`.
  """
  if not isinstance(algorithm, Algorithm):
    raise ValueError(f"algorithm must be a decoding Algorithm (e.g. decoding.Speculative(gamma="
                     f"4)), got {type(algorithm).__name__}")
  encoder_tokens, max_decode_len, rng, row_ids = check_inputs(
      target, encoder_tokens, max_decode_len=max_decode_len, sampling=sampling, rng=rng,
      row_ids=row_ids)
  algorithm = clamp_gamma(algorithm, max_decode_len)
  if algorithm.needs_draft:
    if draft is None:
      raise ValueError(f"{type(algorithm).__name__} needs a draft model (draft=...)")
    if target.vocab_size != draft.vocab_size:
      raise ValueError(f"target and draft vocabularies differ: target vocab_size "
                       f"{target.vocab_size}, draft vocab_size {draft.vocab_size}")
    if draft_encoder_tokens is None:  # checked above (and the vocabularies are equal)
      draft_encoder_tokens = encoder_tokens
    else:
      draft_encoder_tokens = base.validate_tokens(draft_encoder_tokens, "draft_encoder_tokens",
                                                  draft.vocab_size)
    if draft_encoder_tokens.shape[0] != encoder_tokens.shape[0]:
      raise ValueError(f"draft_encoder_tokens batch {draft_encoder_tokens.shape[0]} != "
                       f"encoder_tokens batch {encoder_tokens.shape[0]}")
  else:
    if draft is not None or draft_params is not None or draft_encoder_tokens is not None:
      raise ValueError(f"{type(algorithm).__name__} uses no draft model; do not pass one")
    draft_encoder_tokens = None
  algorithm.check_models(target, draft)
  check_params_fit("target", target, target_params)
  check_params_fit("draft", draft, draft_params)
  check_streamed_params("target", target, target_params)
  check_streamed_params("draft", draft, draft_params)
  if compiler_options is not None and mesh is not None:
    raise ValueError("compiler_options apply to unsharded runs only (mesh=None)")
  if mesh is not None and algorithm.compact_batch:
    raise ValueError(f"{type(algorithm).__name__}(compact_batch=True) runs unsharded only "
                     "(mesh=None)")
  if refill_batch is not None:
    if not is_int(refill_batch) or refill_batch < 1:
      raise ValueError(f"refill_batch must be a positive int, got {refill_batch!r}")
    if mesh is not None:
      raise ValueError("refill_batch runs unsharded only (mesh=None)")
    algorithm.check_refill()
    refill_batch = min(int(refill_batch), encoder_tokens.shape[0])
  if mesh is not None:  # the sharded path lays out device arrays (or global ones) as given
    encoder_tokens, draft_encoder_tokens = (
        None if t is None else jnp.asarray(t, jnp.int32)
        for t in (encoder_tokens, draft_encoder_tokens))
  args = (target_params, draft_params, encoder_tokens, draft_encoder_tokens, rng, row_ids)
  if mesh is None:
    if trim_inputs:
      args = (*args[:2], trim_padding(encoder_tokens), trim_padding(draft_encoder_tokens),
              *args[4:])
    packed = (None, None)
    if pack_inputs and refill_batch is not None:  # one index per chunk of entering rows
      packed = (chunk_packing_index(target, args[2], refill_batch),
                chunk_packing_index(draft, args[3], refill_batch))
    elif pack_inputs:
      packed = (pack_index(target, args[2]), pack_index(draft, args[3]))
    options = compile_options.resolve(compiler_options)
    slots = lambda t: t if t is None or refill_batch is None else t[:2 * refill_batch]
    _before_compile(algorithm, target, draft, max_decode_len, sampling, slots(args[2]),
                    slots(args[3]), (options, tuple(None if i is None else i.shape
                                                    for i in packed), refill_batch),
                    jax.devices()[:1])
    # Weights laid out for this backend's decoding kernels (packed once per tree).
    args = (base.decoding_params(target, target_params),
            base.decoding_params(draft, draft_params), *args[2:])
    try:
      return _unsharded_jit(options)(
          *args, packed, algorithm=algorithm, target=target, draft=draft,
          max_decode_len=max_decode_len, sampling=sampling, refill_batch=refill_batch)
    except jax.errors.JaxRuntimeError as e:
      if "No such compile option" not in str(e):
        raise
      raise ValueError(f"compiler_options {dict(options)}: this jaxlib ({jax.__version__}) "
                       f"refuses one of them: {str(e).splitlines()[0]}") from None
  _before_compile(algorithm, target, draft, max_decode_len, sampling, encoder_tokens,
                  draft_encoder_tokens, (mesh, rules, draft_rules), mesh.devices.flat)
  fn, in_shardings = sharded(algorithm, target, draft, mesh, batch_shape=encoder_tokens.shape,
                             max_decode_len=max_decode_len, sampling=sampling, rules=rules,
                             draft_rules=draft_rules, target_params=target_params,
                             draft_params=draft_params)
  return fn(*partitioning.put(args, in_shardings))
