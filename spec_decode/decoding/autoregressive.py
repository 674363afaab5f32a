"""The autoregressive baseline: one decoder call per token, in one jitted while_loop."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode.decoding.common import check_inputs, row_keys
from spec_decode.decoding.sampling import Sampling, sample_from
from spec_decode.decoding.types import DecodeResult, DecodeStats
from spec_decode.models.t5 import BOS_ID, EOS_ID


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


def autoregressive(model, params, encoder_tokens, *, max_decode_len: int,
                   sampling: Sampling = Sampling(), rng=None,
                   row_ids=None) -> DecodeResult:
  """Decodes up to `max_decode_len` tokens per row, one target call per token.

  rng: PRNG key (required when temperature > 0). row_ids [B]: the ids that key
  each row's randomness (default 0..B-1). Rows stop at EOS independently.
  """
  encoder_tokens, max_decode_len, rng, row_ids = check_inputs(
      model, encoder_tokens, max_decode_len=max_decode_len, sampling=sampling, rng=rng,
      row_ids=row_ids)
  return _autoregressive(model, params, encoder_tokens, rng, row_ids,
                         max_decode_len=max_decode_len, sampling=sampling)


@functools.partial(jax.jit, static_argnames=("model", "max_decode_len", "sampling"))
def _autoregressive(model, params, encoder_tokens, rng, row_ids, *, max_decode_len, sampling):
  B = encoder_tokens.shape[0]
  L = max_decode_len
  cache = model.init_cache(params, model.encode(params, encoder_tokens), L)

  def body(s: _State) -> _State:
    logits, cache = model.decode(params, s.cache, s.last[:, None])
    keys = row_keys(rng, row_ids, s.step)
    tok = jax.vmap(sample_from)(keys, sampling.probs(logits[:, 0]))
    active = ~s.done
    tok = jnp.where(active, tok, 0)
    lengths = s.lengths + active.astype(jnp.int32)
    stats = s.stats.replace(target_calls=s.stats.target_calls + active.astype(jnp.int32))
    return _State(step=s.step + 1, last=tok, tokens=s.tokens.at[:, s.step].set(tok),
                  lengths=lengths, done=s.done | (tok == EOS_ID) | (lengths >= L),
                  cache=cache, stats=stats)

  init = _State(step=jnp.int32(0), last=jnp.full((B,), BOS_ID, jnp.int32),
                tokens=jnp.zeros((B, L), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
                done=jnp.zeros((B,), bool), cache=cache, stats=DecodeStats.zeros(B))
  s = jax.lax.while_loop(lambda s: (s.step < L) & ~jnp.all(s.done), body, init)
  return DecodeResult(tokens=s.tokens, lengths=s.lengths, stats=s.stats)
