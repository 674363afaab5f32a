"""The autoregressive baseline: one decoder call per token, in one jitted while_loop."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode.decoding import registry, runner
from spec_decode.decoding.sampling import Sampling, next_token
from spec_decode.decoding.types import DecodeResult, DecodeStats
from spec_decode.models.base import BOS_ID, EOS_ID


@flax.struct.dataclass
class _State:
  """Loop state. step: scalar, tokens generated so far by active rows.

  last [B]: the token fed next; tokens [B, L]; lengths [B]; done [B] bool.
  """
  step: jax.Array
  last: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  cache: object
  stats: DecodeStats


@registry.algorithm("autoregressive")
@dataclasses.dataclass(frozen=True)
class Autoregressive(runner.Algorithm):
  """One target call per token: the baseline every speedup is measured against.

  compact_batch: shrink the batch as rows finish (`runner.compacting_loop`), as
  `Speculative(compact_batch=True)` does; outputs unchanged.
  """
  compact_batch: bool = False

  def __post_init__(self):
    if not isinstance(self.compact_batch, bool):
      raise ValueError(f"compact_batch must be True or False, got {self.compact_batch!r}")

  def init_stats(self, batch_size: int) -> DecodeStats:
    return DecodeStats.zeros(batch_size, target_calls=((), jnp.int32),
                             nonfinite_calls=((), jnp.int32))

  def loop_parts(self, ctx: runner.LoopContext) -> runner.LoopParts:
    B, L = ctx.batch_size, ctx.max_decode_len
    init = _State(step=jnp.int32(0), last=jnp.full((B,), BOS_ID, jnp.int32),
                  tokens=jnp.zeros((B, L), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
                  done=jnp.zeros((B,), bool), cache=ctx.start_cache("target", L),
                  stats=self.init_stats(B))
    init = init.replace(**ctx.constrain_batch(
        dict(last=init.last, tokens=init.tokens, lengths=init.lengths, done=init.done,
             stats=init.stats)))
    return runner.LoopParts(
        ctx=ctx, init=init, rows_of=lambda s: s.replace(step=None),
        with_rows=lambda s, part: part.replace(step=s.step),
        result_of=lambda s: (s.tokens, s.lengths, s.stats), done_of=lambda s: s.done,
        make_body=self._body, cond=lambda s: s.step < L,
        finish=lambda r: DecodeResult(tokens=r[0], lengths=r[1], stats=r[2]))

  def _body(self, ctx: runner.LoopContext):
    """The loop body for the rows of `ctx` (all of them, those a compacting loop kept, or a
    refilling loop's slots). A row's step is its own count of target calls (its length),
    so a row that entered the loop late draws and writes as it would alone."""
    L = ctx.max_decode_len
    model, params, sampling = ctx.target, ctx.target_params, ctx.sampling

    def body(s: _State) -> _State:
      out = model.decode(params, s.cache, s.last[:, None])
      active = ~s.done
      # A finished row is still decoded (the batch is one call) but its cache is rewound,
      # as the speculative loop rewinds its finished rows: otherwise each later step would
      # append a slot its attention reads (a plain batch's early finishers read up to the
      # slowest row's length every step).
      cache = out.cache.rewind(jnp.where(active, out.cache.lengths, s.cache.lengths))
      cache = ctx.constrain_cache(cache, "target")
      tok = next_token(ctx.keys(s.stats.target_calls), out.logits[:, 0], sampling)
      tok = jnp.where(active, tok, 0)
      lengths = s.lengths + active.astype(jnp.int32)
      rows = jnp.arange(tok.shape[0])
      at = jnp.where(active, s.lengths, L)  # finished rows write nothing (out of range)
      return _State(step=s.step + 1, last=tok, tokens=s.tokens.at[rows, at].set(tok, mode="drop"),
                    lengths=lengths, done=s.done | (tok == EOS_ID) | (lengths >= L),
                    cache=cache, stats=s.stats.add(
                        target_calls=active,
                        nonfinite_calls=active & runner.nonfinite_rows(out.logits)))

    return body


def autoregressive(model, params, encoder_tokens, *, max_decode_len: int,
                   sampling: Sampling = Sampling(), rng=None,
                   row_ids=None, mesh=None, rules=None) -> DecodeResult:
  """Decodes up to `max_decode_len` tokens per row, one target call per token.

  rng: PRNG key (required when temperature > 0). row_ids [B]: the ids that key
  each row's randomness (default 0..B-1). Rows stop at EOS independently.

  mesh: a `jax.sharding.Mesh` (see `partitioning.make_mesh`) to run sharded:
  parameters, caches and encoder outputs are laid out by their logical axes
  under `rules` (default T5X's), the batch over `data` when it divides
  (replicated otherwise), and the result is batch-sharded. Inputs may already
  be global arrays (several hosts). The tokens equal the unsharded ones.
  """
  return runner.run(Autoregressive(), model, params, encoder_tokens,
                    max_decode_len=max_decode_len, sampling=sampling, rng=rng, row_ids=row_ids,
                    mesh=mesh, rules=rules)
