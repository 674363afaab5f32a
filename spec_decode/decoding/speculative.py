"""Speculative decoding (Leviathan et al. 2023, Algorithm 1), batched and ragged, in one jit.

Notation: a row's sequence is s_0 = BOS, s_1 .. s_m (m = tokens produced).
Invariants at the top of each iteration, per row:
  * the target cache holds s_0 .. s_{m-1} (length m); s_m is fed next;
  * the draft cache holds at least s_0 .. s_{m-2}; it is rewound to m - 1 and
    fed [s_{m-1}, s_m] (one 2-token call), which also catches up on the last
    draft token when all gamma were accepted. On the first iteration (m = 0)
    it is fed [s_0] alone.

One iteration: gamma draft proposals x_1..x_g ~ q_1..q_g (one 2-token call,
then gamma - 1 single-token calls in a lax.scan); ONE target call on
[s_m, x_1..x_g] giving p_1..p_{g+1}; accept x_i while u_i * q_i(x_i) < p_i(x_i);
with n accepted, draw the extra token from norm(max(0, p_{n+1} - q_{n+1}))
(q_{g+1} := 0, so that is p_{g+1} when all were accepted). Each row appends
its own n + 1 tokens (cut at EOS or max_decode_len) and both caches rewind to
that row's length. Finished rows keep computing but never change.

p and q are the *adjusted* distributions of the same `Sampling` (the paper's
standardized sampling), so the output is distributed exactly as the target's
adjusted sampling; at temperature 0 it equals greedy decoding of the target.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import partitioning
from spec_decode.decoding.common import check_inputs, row_keys
from spec_decode.decoding.sampling import Sampling, draw
from spec_decode.decoding.types import DecodeResult, DecodeStats
from spec_decode.models import t5
from spec_decode.models.t5 import BOS_ID, EOS_ID


@flax.struct.dataclass
class _State:
  """Loop state.

  it:     scalar iteration count (same for all rows; keys use it as the step).
  out:    [B, L + gamma + 1] produced tokens s_1.. (junk beyond each row's length).
  length: [B] m, tokens produced per row.
  done:   [B] bool.
  target_cache, draft_cache: caches per the module docstring's invariants.
  stats:  per-row DecodeStats.
  """
  it: jax.Array
  out: jax.Array
  length: jax.Array
  done: jax.Array
  target_cache: object
  draft_cache: object
  stats: DecodeStats

  def token_at(self, index: jax.Array) -> jax.Array:
    """s_index per row (s_0 = BOS), for index [B] in [0, length]."""
    idx = jnp.maximum(index - 1, 0)
    tok = jnp.take_along_axis(self.out, idx[:, None], axis=1)[:, 0]
    return jnp.where(index == 0, BOS_ID, tok)


def speculative(target, target_params, draft, draft_params, encoder_tokens, *, gamma: int,
                max_decode_len: int, sampling: Sampling = Sampling(), rng=None, row_ids=None,
                draft_encoder_tokens=None, lenience: float = 1.0, mesh=None, rules=None,
                draft_rules=None) -> DecodeResult:
  """Decodes with `draft` proposing `gamma` tokens per call of `target`.

  Both models implement the `Decoder` protocol and must share the vocabulary.
  draft_encoder_tokens: the draft's own encoder input when it differs from the
  target's (another length or tokenization of the same vocabulary); default
  the same tokens. row_ids: as in `autoregressive`.

  lenience: the paper's appendix A.5 (LOSSY). With l < 1 a draft token is
  accepted with probability min(1, p / (l q)) and rejections resample from
  norm(max(0, p - l q)): faster, but the output no longer follows the target's
  distribution. The default 1.0 is exact.

  mesh: run sharded on this `jax.sharding.Mesh` (as in `autoregressive`).
  The target is laid out by `rules` (default T5X's); the draft by
  `draft_rules`, default `partitioning.data_parallel_rules(rules)`: its
  parameters replicated on every device and only its batch sharded (a small
  draft's weights fit everywhere, and model-parallel collectives would cost
  more than its matmuls). Pass `draft_rules=rules` to shard it like the target.
  """
  if not isinstance(gamma, (int, np.integer)) or isinstance(gamma, bool) or gamma < 1:
    raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
  gamma = int(gamma)
  if target.vocab_size != draft.vocab_size:
    raise ValueError(f"target and draft vocabularies differ: target vocab_size "
                     f"{target.vocab_size}, draft vocab_size {draft.vocab_size}")
  if not (0.0 < lenience <= 1.0):
    raise ValueError(f"lenience must be in (0, 1], got {lenience}")
  encoder_tokens, max_decode_len, rng, row_ids = check_inputs(
      target, encoder_tokens, max_decode_len=max_decode_len, sampling=sampling, rng=rng,
      row_ids=row_ids)
  if draft_encoder_tokens is None:
    draft_encoder_tokens = encoder_tokens
  draft_encoder_tokens = t5._check_tokens(draft_encoder_tokens, "draft_encoder_tokens",
                                          draft.vocab_size)
  if draft_encoder_tokens.shape[0] != encoder_tokens.shape[0]:
    raise ValueError(f"draft_encoder_tokens batch {draft_encoder_tokens.shape[0]} != "
                     f"encoder_tokens batch {encoder_tokens.shape[0]}")
  if mesh is None:
    return _speculative(target, draft, target_params, draft_params, encoder_tokens,
                        draft_encoder_tokens, rng, row_ids, gamma=gamma,
                        max_decode_len=max_decode_len, sampling=sampling,
                        lenience=float(lenience))
  rules = partitioning.standard_logical_axis_rules() if rules is None else \
      partitioning.validate_rules(rules)
  draft_rules = partitioning.data_parallel_rules(rules) if draft_rules is None else \
      partitioning.validate_rules(draft_rules)
  batch = partitioning.batch_sharding(mesh, encoder_tokens.shape, rules)
  in_shardings = (partitioning.param_shardings(target, mesh, rules, params=target_params),
                  partitioning.param_shardings(draft, mesh, draft_rules, params=draft_params),
                  batch, batch, partitioning.replicated(mesh), batch)
  args = partitioning.put((target_params, draft_params, encoder_tokens, draft_encoder_tokens,
                           rng, row_ids), in_shardings)
  fn = partitioning.sharded_jit(_speculative_impl, in_shardings, batch, target=target,
                                draft=draft, gamma=gamma, max_decode_len=max_decode_len,
                                sampling=sampling, lenience=float(lenience), mesh=mesh,
                                rules=rules, draft_rules=draft_rules)
  return fn(*args)


def _take(probs_BGV, tokens_BG):
  return jnp.take_along_axis(probs_BGV, tokens_BG[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("target", "draft", "gamma", "max_decode_len",
                                             "sampling", "lenience"))
def _speculative(target, draft, target_params, draft_params, encoder_tokens,
                 draft_encoder_tokens, rng, row_ids, *, gamma, max_decode_len, sampling,
                 lenience):
  return _speculative_impl(target_params, draft_params, encoder_tokens, draft_encoder_tokens,
                           rng, row_ids, target=target, draft=draft, gamma=gamma,
                           max_decode_len=max_decode_len, sampling=sampling, lenience=lenience)


def _speculative_impl(target_params, draft_params, encoder_tokens, draft_encoder_tokens, rng,
                      row_ids, *, target, draft, gamma, max_decode_len, sampling, lenience,
                      mesh=None, rules=None, draft_rules=None):
  """The loop; with a mesh, caches and state get sharding constraints by logical axes."""
  B = encoder_tokens.shape[0]
  L, g = max_decode_len, gamma
  room = L + g + 1  # a frozen row (length L) still writes g + 1 slots per iteration

  def start(model, params, tokens, model_rules):
    encoded = model.encode(params, tokens)
    encoded = partitioning.constrain(encoded, partitioning.encoder_output_axes(encoded), mesh,
                                     model_rules)
    return partitioning.constrain_cache(model.init_cache(params, encoded, room), model, mesh,
                                        model_rules)

  target_cache = start(target, target_params, encoder_tokens, rules)
  draft_cache = start(draft, draft_params, draft_encoder_tokens, draft_rules)

  def draft_phase(s: _State, keys_BG):
    """Proposes x [B, g] with their adjusted draft distributions q [B, g, V]."""
    m = s.length
    last = s.token_at(m)

    def first_call():
      logits, c = draft.decode(draft_params, s.draft_cache, last[:, None])
      return logits[:, -1], c

    def catch_up_call():
      tokens = jnp.stack([s.token_at(m - 1), last], axis=1)
      logits, c = draft.decode(draft_params, s.draft_cache.rewind(m - 1), tokens)
      return logits[:, -1], c

    logits, cache = jax.lax.cond(s.it == 0, first_call, catch_up_call)
    q1 = sampling.probs(logits)
    x1 = draw(keys_BG[:, 0], q1, greedy=sampling.greedy)

    def step(carry, key_B):
      cache, x = carry
      logits, cache = draft.decode(draft_params, cache, x[:, None])
      q = sampling.probs(logits[:, 0])
      x = draw(key_B, q, greedy=sampling.greedy)
      return (cache, x), (x, q)

    cache = partitioning.constrain_cache(cache, draft, mesh, draft_rules)
    (cache, _), (xs, qs) = jax.lax.scan(step, (cache, x1), jnp.swapaxes(keys_BG[:, 1:], 0, 1))
    x = jnp.concatenate([x1[:, None], jnp.swapaxes(xs, 0, 1)], axis=1)
    q = jnp.concatenate([q1[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    return x, q, cache

  def body(s: _State) -> _State:
    keys = row_keys(rng, row_ids, s.it)
    split = jax.vmap(lambda k: jax.random.split(k, g + 2))(keys)  # [B, g + 2, key]
    draft_keys, accept_keys, correct_keys = split[:, :g], split[:, g], split[:, g + 1]
    m = s.length
    active = ~s.done

    x, q, draft_cache = draft_phase(s, draft_keys)
    target_in = jnp.concatenate([s.token_at(m)[:, None], x], axis=1)  # [B, g + 1]
    logits, target_cache = target.decode(target_params, s.target_cache, target_in)
    target_cache = partitioning.constrain_cache(target_cache, target, mesh, rules)
    draft_cache = partitioning.constrain_cache(draft_cache, draft, mesh, draft_rules)
    p = sampling.probs(logits)  # [B, g + 1, V]

    # Rejection sampling: accept x_i while u_i * l * q_i(x_i) < p_i(x_i).
    if sampling.greedy:
      # q is one-hot at x and p one-hot, so the test is p(x) = 1 whatever u < 1 is (and
      # the random keys become dead code).
      accept = _take(p[:, :g], x) > 0
    else:
      u = jax.vmap(lambda k: jax.random.uniform(k, (g,)))(accept_keys)
      accept = u * lenience * _take(q, x) < _take(p[:, :g], x)
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]

    # Extra token from norm(max(0, p_{n+1} - l q_{n+1})), with q_{g+1} = 0.
    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q_ext, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - lenience * q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only through rounding when p ~ q; p_n itself is then the right law.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    extra = draw(correct_keys, residual, greedy=sampling.greedy)

    # New tokens x_1..x_n, extra; cut after the first EOS and at max_decode_len.
    j = jnp.arange(g + 1)[None, :]
    x_ext = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    new = jnp.where(j < n[:, None], x_ext, jnp.where(j == n[:, None], extra[:, None], 0))
    is_eos = (new == EOS_ID) & (j <= n[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, g + 1), axis=1)
    count = jnp.minimum(jnp.minimum(n + 1, first_eos + 1), L - m)
    count = jnp.where(active, count, 0)
    new_length = m + count
    write = lambda row, vals, at: jax.lax.dynamic_update_slice(row, vals, (at,))
    out = jax.vmap(write)(s.out, new, m)
    done = s.done | (active & ((first_eos < count) | (new_length >= L)))

    decided = jnp.minimum(n + 1, g)
    decided_at = (j[:, :g] < decided[:, None]) & active[:, None]  # [B, g]
    accepted_at = (j[:, :g] < n[:, None]) & active[:, None]
    beta = jnp.sum(jnp.minimum(p[:, :g] / lenience, q), axis=-1)  # [B, g]
    a = active.astype(jnp.int32)
    st = s.stats
    stats = DecodeStats(target_calls=st.target_calls + a, draft_tokens=st.draft_tokens + g * a,
                        accepted=st.accepted + n * a, decisions=st.decisions + decided * a,
                        min_pq_sum=st.min_pq_sum + jnp.sum(jnp.where(decided_at, beta, 0.0), 1),
                        accepted_at=st.accepted_at + accepted_at.astype(jnp.int32),
                        decided_at=st.decided_at + decided_at.astype(jnp.int32))
    return _State(it=s.it + 1, out=out, length=new_length, done=done,
                  target_cache=target_cache.rewind(new_length), draft_cache=draft_cache,
                  stats=stats)

  init = _State(it=jnp.int32(0), out=jnp.zeros((B, room), jnp.int32),
                length=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
                target_cache=target_cache, draft_cache=draft_cache,
                stats=DecodeStats.zeros(B, gamma=g))
  init = init.replace(**partitioning.constrain_batch(
      dict(out=init.out, length=init.length, done=init.done, stats=init.stats), mesh, rules))
  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
  tokens = jnp.where(jnp.arange(L)[None, :] < s.length[:, None], s.out[:, :L], 0)
  return DecodeResult(tokens=tokens, lengths=s.length, stats=s.stats)
