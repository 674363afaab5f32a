"""The autoregressive baseline: one decoder call per token, in one jitted while_loop."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode import partitioning
from spec_decode.decoding.common import check_inputs, row_keys
from spec_decode.decoding.sampling import Sampling, draw
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
  encoder_tokens, max_decode_len, rng, row_ids = check_inputs(
      model, encoder_tokens, max_decode_len=max_decode_len, sampling=sampling, rng=rng,
      row_ids=row_ids)
  if mesh is None:
    return _autoregressive(model, params, encoder_tokens, rng, row_ids,
                           max_decode_len=max_decode_len, sampling=sampling)
  rules = partitioning.standard_logical_axis_rules() if rules is None else \
      partitioning.validate_rules(rules)
  batch = partitioning.batch_sharding(mesh, encoder_tokens.shape, rules)
  in_shardings = (partitioning.param_shardings(model, mesh, rules, params=params), batch,
                  partitioning.replicated(mesh), batch)
  args = partitioning.put((params, encoder_tokens, rng, row_ids), in_shardings)
  fn = partitioning.sharded_jit(_autoregressive_impl, in_shardings, batch, model=model,
                                max_decode_len=max_decode_len, sampling=sampling, mesh=mesh,
                                rules=rules)
  return fn(*args)


@functools.partial(jax.jit, static_argnames=("model", "max_decode_len", "sampling"))
def _autoregressive(model, params, encoder_tokens, rng, row_ids, *, max_decode_len, sampling):
  return _autoregressive_impl(params, encoder_tokens, rng, row_ids, model=model,
                              max_decode_len=max_decode_len, sampling=sampling)


def _autoregressive_impl(params, encoder_tokens, rng, row_ids, *, model, max_decode_len,
                         sampling, mesh=None, rules=None):
  """The loop; with a mesh, caches and state get sharding constraints by logical axes."""
  B = encoder_tokens.shape[0]
  L = max_decode_len
  encoded = model.encode(params, encoder_tokens)
  encoded = partitioning.constrain(encoded, partitioning.encoder_output_axes(encoded), mesh, rules)
  cache = partitioning.constrain_cache(model.init_cache(params, encoded, L), model, mesh, rules)

  def body(s: _State) -> _State:
    logits, cache = model.decode(params, s.cache, s.last[:, None])
    cache = partitioning.constrain_cache(cache, model, mesh, rules)
    keys = row_keys(rng, row_ids, s.step)
    tok = draw(keys, sampling.probs(logits[:, 0]), greedy=sampling.greedy)
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
  init = init.replace(**partitioning.constrain_batch(
      dict(last=init.last, tokens=init.tokens, lengths=init.lengths, done=init.done,
           stats=init.stats), mesh, rules))
  s = jax.lax.while_loop(lambda s: (s.step < L) & ~jnp.all(s.done), body, init)
  return DecodeResult(tokens=s.tokens, lengths=s.lengths, stats=s.stats)
