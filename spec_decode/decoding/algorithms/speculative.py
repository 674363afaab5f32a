"""Speculative decoding (Leviathan et al. 2023, Algorithm 1), batched and ragged, in one jit.

Notation: a row's sequence is s_0 = BOS, s_1 .. s_m (m = tokens produced).
At the top of each iteration the target cache holds s_0 .. s_{m-1} and s_m is
fed next. One iteration, per row:

  propose: the drafter proposes K tokens (a chain, or a tree whose node i has
           parent[i]) with their draft laws q;
  verify:  ONE target call on [s_m, proposal] (a tree gets positions m + depth
           and an ancestor mask) gives p at the root and after every node; the
           verifier accepts n nodes along one path and draws one extra token;
  commit:  the row appends its own n + 1 tokens (cut at EOS or
           max_decode_len); the target cache keeps s_m and the accepted path's
           entries (for a chain that is a rewind) and the drafter updates its state.

p and q are the *adjusted* distributions of the same `Sampling` (the paper's
standardized sampling), so with an exact verifier the output is distributed
exactly as the target's adjusted sampling; at temperature 0 it equals greedy
decoding of the target. Finished rows keep computing but never change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode import theory
from spec_decode.decoding import registry, runner
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.drafters.model import ModelDrafter
from spec_decode.decoding.sampling import Sampling, argmax
from spec_decode.decoding.types import Committed, DecodeResult, DecodeStats
from spec_decode.decoding.verifiers.base import Verifier
from spec_decode.decoding.verifiers.chain import ChainVerifier, greedy_verdict
from spec_decode.models.base import EOS_ID, on_cpu_unless_set


@flax.struct.dataclass
class _State:
  """Loop state.

  it:     scalar iteration count (same for all rows; keys use it as the step).
  out:    [B, L + K + 1] produced tokens s_1.. (junk beyond each row's length).
  length: [B] m, tokens produced per row.
  done:   [B] bool.
  target_cache: holds s_0 .. s_{m-1}; draft: the drafter's state.
  stats:  per-row DecodeStats.
  """
  it: jax.Array
  out: jax.Array
  length: jax.Array
  done: jax.Array
  target_cache: object
  draft: object
  stats: DecodeStats


@registry.algorithm("speculative")
@dataclasses.dataclass(frozen=True)
class Speculative(runner.Algorithm):
  """gamma tokens proposed per target call; lenience in (0, 1] (1 = exact; < 1 is lossy).

  drafter: what proposes (default: the draft model, one token per call);
  verifier: what accepts (default: token-level rejection sampling).
  compact_batch: shrink the batch as rows finish (`runner.compacting_loop`: halved
  whenever at most half the rows are active; unsharded runs); every row's output is
  unchanged, the iterations after most rows finished cost a smaller batch.
  trim_verify: for drafters whose proposals often fall short of gamma
  (`Drafter.varies_length`: source lookup), verify only as many positions as the longest
  active row needs, among `verify_sizes(K)` (see `_verify_call`); outputs unchanged.
  """
  gamma: int = 4
  lenience: float = 1.0
  drafter: Drafter = ModelDrafter()
  verifier: Verifier = ChainVerifier()
  compact_batch: bool = False
  trim_verify: bool = True

  @property
  def needs_draft(self) -> bool:
    """Whether `run` must be given a draft model: the drafter's `needs_draft_model`."""
    return self.drafter.needs_draft_model

  def __post_init__(self):
    if not runner.is_int(self.gamma) or self.gamma < 1:
      raise ValueError(f"gamma must be an int >= 1, got {self.gamma!r}")
    object.__setattr__(self, "gamma", int(self.gamma))
    if not isinstance(self.lenience, (int, float)) or not 0.0 < self.lenience <= 1.0:
      raise ValueError(f"lenience must be in (0, 1], got {self.lenience}")
    object.__setattr__(self, "lenience", float(self.lenience))
    if not isinstance(self.drafter, Drafter):
      raise ValueError(f"drafter must be a decoding Drafter, got {type(self.drafter).__name__}")
    if not isinstance(self.verifier, Verifier):
      raise ValueError(f"verifier must be a decoding Verifier, got "
                       f"{type(self.verifier).__name__}")
    if self.lenience < 1.0 and not self.verifier.supports_lenience:
      raise ValueError(f"{type(self.verifier).__name__} does not support lenience < 1")
    if self.drafter.proposes_trees and self.verifier.chain_only:
      raise ValueError(f"{type(self.drafter).__name__} proposes trees but "
                       f"{type(self.verifier).__name__} verifies chains only; use a tree "
                       f"verifier, e.g. TreeVerifier()")
    self.verifier.check_drafter(self.drafter)
    for name in ("compact_batch", "trim_verify"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

  @property
  def max_proposal(self) -> int:
    """K, the most tokens one proposal holds (per-position counters are [B, K])."""
    return self.drafter.proposal_size(self.gamma)

  def check_models(self, target, draft) -> None:
    self.drafter.check_models(target, draft)

  def cache_room(self, max_decode_len: int) -> int:
    # a frozen row (length L) still writes K + 1 slots per iteration
    return max_decode_len + self.max_proposal + 1

  def init_stats(self, batch_size: int) -> DecodeStats:
    i, f, K = jnp.int32, jnp.float32, (self.max_proposal,)
    extra = {"draft_mass_at": (K, f)} if self.drafter.reports_confidence else {}
    return DecodeStats.zeros(batch_size, target_calls=((), i), nonfinite_calls=((), i),
                             draft_tokens=((), i),
                             accepted=((), i), decisions=((), i), min_pq_sum=((), f),
                             accepted_at=(K, i), decided_at=(K, i),
                             first_call_tokens=((), i), **extra)

  def cost_model(self, *, alpha: float, draft_cost: float, verify_ratio: float,
                 counters=None) -> dict[str, Any] | None:
    """What this decoder's costs predict, or None when its drafter predicts no yield.

    alpha: the measured acceptance rate; draft_cost: one proposal in target steps (its
    drafter's `proposal_seconds` / T_p); verify_ratio: T_verify(K + 1) / T_p; counters:
    the decoder's summed counters (a tree predicts its yield from its confidences).
      expected_tokens: the drafter's E[tokens per target call] (`Drafter.expected_tokens`);
      thm_3_8: E / (draft_cost + 1), Theorem 3.8's charge of one step per verify call (a
        chain: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), c = draft_cost / gamma);
      cost_model: E / (draft_cost + verify_ratio), the measured verify cost charged;
      optimal_gamma: Theorem 3.8's best gamma at c (chains; None for trees).
    """
    tokens = self.drafter.expected_tokens(alpha=alpha, gamma=self.gamma, counters=counters)
    if tokens is None:
      return None
    chain = not self.drafter.proposes_trees
    return {"thm_3_8": tokens / (draft_cost + 1.0),
            "cost_model": tokens / (draft_cost + verify_ratio),
            "expected_tokens": tokens,
            "optimal_gamma": (int(theory.optimal_gamma(alpha, draft_cost / self.gamma))
                              if chain else None)}

  def loop_parts(self, ctx: runner.LoopContext) -> runner.LoopParts:
    B, L = ctx.batch_size, ctx.max_decode_len
    ctx = ctx.with_target_encoded()  # the target cache and the drafter share one encoding
    room = self.cache_room(L)
    init = _State(it=jnp.int32(0), out=jnp.zeros((B, room), jnp.int32),
                  length=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
                  target_cache=ctx.start_cache("target", room),
                  draft=self.drafter.init(ctx, room), stats=self.init_stats(B))
    init = init.replace(**ctx.constrain_batch(
        dict(out=init.out, length=init.length, done=init.done, stats=init.stats)))

    def finish(results):
      out, length, stats = results
      tokens = jnp.where(jnp.arange(L)[None, :] < length[:, None], out[:, :L], 0)
      return DecodeResult(tokens=tokens, lengths=length, stats=stats)

    return runner.LoopParts(
        ctx=ctx, init=init, rows_of=lambda s: s.replace(it=None),
        with_rows=lambda s, part: part.replace(it=s.it),
        result_of=lambda s: (s.out, s.length, s.stats), done_of=lambda s: s.done,
        make_body=self._body, finish=finish)

  def _body(self, ctx: runner.LoopContext):
    """The loop body for the rows of `ctx` (all of them, those a compacting loop kept, or a
    refilling loop's slots)."""
    B, L, g = ctx.batch_size, ctx.max_decode_len, self.gamma
    K = self.max_proposal
    target, params, sampling = ctx.target, ctx.target_params, ctx.sampling

    def body(s: _State) -> _State:
      keys = ctx.keys(s.stats.target_calls)  # the row's own iteration (== it while active)
      split = jax.vmap(lambda k: jax.random.split(k, g + 2))(keys)  # [B, g + 2, key]
      draft_keys, accept_keys, correct_keys = split[:, :g], split[:, g], split[:, g + 1]
      m = s.length
      active = ~s.done
      committed = Committed(tokens=s.out, length=m, it=s.it)

      proposal, draft_state = self.drafter.propose(ctx, s.draft, committed, draft_keys, g)
      target_in = jnp.concatenate([committed.token_at(m)[:, None], proposal.tokens], axis=1)
      layers = self.drafter.target_layers(ctx.draft)  # multi-layer features, when asked
      extra = {"layers": layers} if layers else {}
      if self.verifier.chain_only:
        out = None if layers else self.drafter.verify_call(ctx, draft_state, s.target_cache,
                                                           target_in, proposal)
        if out is None:
          out = self._verify_call(target, params, s.target_cache, target_in, proposal,
                                  active, extra)
      else:
        depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), proposal.depths()], axis=1)
        tree = proposal.ancestor_mask()  # among the nodes; every node sees s_m
        mask = jnp.concatenate([jnp.zeros((B, 1, K), bool), tree], axis=1)
        mask = jnp.concatenate([jnp.ones((B, K + 1, 1), bool), mask], axis=2)
        out = self._verify_call(target, params, s.target_cache, target_in, proposal, active,
                                extra, tree=(m[:, None] + depth, mask))
      target_cache = ctx.constrain_cache(out.cache, "target")
      if sampling.greedy and self.verifier.chain_only and self.verifier.greedy_is_matching:
        verdict = greedy_verdict(argmax(out.logits), proposal)
      else:
        p = sampling.probs(out.logits)  # [B, K + 1, V]
        verdict = self.verifier.verify(p, proposal, accept_keys, correct_keys,
                                       sampling=sampling, lenience=self.lenience)
      n = verdict.accepted

      # New tokens: the accepted path, then the extra token; cut after the first EOS and at L.
      j = jnp.arange(K + 1)[None, :]
      path_tokens = jnp.take_along_axis(proposal.tokens, verdict.path, axis=1)
      path_ext = jnp.concatenate([path_tokens, jnp.zeros_like(path_tokens[:, :1])], axis=1)
      new = jnp.where(j < n[:, None], path_ext, jnp.where(j == n[:, None],
                                                          verdict.extra[:, None], 0))
      is_eos = (new == EOS_ID) & (j <= n[:, None])
      first_eos = jnp.min(jnp.where(is_eos, j, K + 1), axis=1)
      count = jnp.minimum(jnp.minimum(n + 1, first_eos + 1), L - m)
      count = jnp.where(active, count, 0)
      new_length = m + count
      write = lambda row, vals, at: jax.lax.dynamic_update_slice(row, vals, (at,))
      out_tokens = jax.vmap(write)(s.out, new, m)
      done = s.done | (active & ((first_eos < count) | (new_length >= L)))

      if self.verifier.chain_only:
        target_cache = target_cache.rewind(new_length)
      else:  # keep s_m (entry 0) and the accepted nodes (entries path + 1), in order
        kept = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), verdict.path + 1], axis=1)
        target_cache = target_cache.keep(m, kept, count)
      committed = Committed(tokens=out_tokens, length=new_length, it=s.it,
                            target_hidden=(jnp.concatenate([out.hidden, out.features], -1)
                                           if layers else out.hidden))
      draft_state = self.drafter.commit(ctx, draft_state, committed, verdict, proposal)

      decided_at = (j[:, :K] < verdict.decided[:, None]) & active[:, None]  # [B, K]
      accepted_at = (j[:, :K] < n[:, None]) & active[:, None]
      a = active.astype(jnp.int32)
      extra = {}
      if self.drafter.reports_confidence:  # the proposal's confidences, largest first
        extra["draft_mass_at"] = -jnp.sort(-proposal.confidence, axis=1) * a[:, None]
      stats = s.stats.add(target_calls=a, nonfinite_calls=runner.nonfinite_rows(out.logits) * a,
                          draft_tokens=proposal.proposed * a, accepted=n * a,
                          decisions=verdict.decided * a,
                          min_pq_sum=jnp.sum(jnp.where(decided_at, verdict.beta, 0.0), 1),
                          accepted_at=accepted_at, decided_at=decided_at,
                          first_call_tokens=jnp.where(m == 0, count, 0), **extra)
      return _State(it=s.it + 1, out=out_tokens, length=new_length, done=done,
                    target_cache=target_cache, draft=draft_state, stats=stats)

    return body

  def _verify_call(self, target, params, cache, target_in, proposal, active, extra,
                   tree=None):
    """The target's call on [s_m, proposal] (target_in [B, K + 1]; tree: (positions
    [B, K + 1], tree_mask [B, K + 1, K + 1]) for a tree). The proposal of a drafter that
    often proposes fewer than K tokens (`Drafter.varies_length`: a chain of `length`
    tokens, or a tree with its real nodes first) is scored on only the first
    `verify_sizes` entry that holds 1 + the longest active row's proposal (one call per
    size, the chosen one run: `_switch_through_loops_call` on the CPU, else a lax.switch;
    logits and states padded back to K + 1, never read past a row's proposal), so a step
    where no row proposes anything costs one target step."""
    K1 = target_in.shape[1]

    def call(T):
      def run(cache, target_in):
        kw = dict(extra)
        if tree is not None:
          kw.update(positions=tree[0][:, :T], tree_mask=tree[1][:, :T, :T])
        out = target.decode(params, cache, target_in[:, :T], **kw)
        if T == K1:
          return out
        pad = lambda x: None if x is None else jnp.pad(
            x, [(0, 0), (0, K1 - T)] + [(0, 0)] * (x.ndim - 2))
        return out.replace(logits=pad(out.logits), hidden=pad(out.hidden),
                           features=pad(out.features))
      return run

    trims = self.trim_verify and self.drafter.varies_length
    if not trims or (tree is None and proposal.length is None):
      return call(K1)(cache, target_in)
    sizes = verify_sizes(K1 - 1)
    need = 1 + jnp.max(jnp.where(active, proposal.proposed, 0))
    index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), need).astype(jnp.int32)
    index = jnp.minimum(index, len(sizes) - 1)
    branches = [call(T) for T in sizes]
    if not _switch_through_loops():
      return jax.lax.switch(index, branches, cache, target_in)
    return _switch_through_loops_call(index, branches, cache, target_in)


# How `_verify_call` picks its verify size: None (the default) runs the chosen call in
# while loops on the CPU backend and in a lax.switch elsewhere; True or False forces
# loops or the switch (for A/B measurements). XLA gives a conditional's result a buffer
# of its own, so every branch of a lax.switch that writes into the cache copies all of
# it first; a while loop's carry keeps its buffer (`_switch_through_loops_call`).
SWITCH_THROUGH_LOOPS: bool | None = None


def _switch_through_loops() -> bool:
  return on_cpu_unless_set(SWITCH_THROUGH_LOOPS, "speculative.SWITCH_THROUGH_LOOPS")


def _switch_through_loops_call(index, branches, cache, target_in):
  """branches[index](cache, target_in), as `jax.lax.switch` gives it, with the cache
  carried through one while loop per branch that runs its body once when the branch is
  the chosen one and never otherwise. In place: with lax.switch, XLA copied every layer's
  K and V cache once per step (the conditional's result gets a fresh buffer, and copy
  insertion copies each branch's in-place writes out of its operand). The outputs other
  than the cache start as zeros of the widest branch's shapes (all branches return the
  same shapes)."""
  shapes = jax.eval_shape(branches[-1], cache, target_in)
  out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes).replace(cache=cache)
  for i, branch in enumerate(branches):
    runs = (index == i).astype(jnp.int32)  # the trip count: 1 for the chosen branch, else 0

    def body(carry, branch=branch):
      count, previous = carry
      return count + 1, branch(previous.cache, target_in)

    _, out = jax.lax.while_loop(lambda carry, runs=runs: carry[0] < runs, body,
                                (jnp.int32(0), out))
  return out


def verify_sizes(K: int) -> tuple[int, ...]:
  """The verify call's token counts for chains of up to K tokens with ragged lengths:
  1, 2, 3, 5, 9, .. (1 + powers of two) below K + 1, and K + 1."""
  sizes, n = {1, K + 1}, 1
  while n < K:
    sizes.add(1 + n)
    n *= 2
  return tuple(sorted(sizes))


def speculative(target, target_params, draft, draft_params, encoder_tokens, *, gamma: int,
                max_decode_len: int, sampling: Sampling = Sampling(), rng=None,
                lenience: float = 1.0, row_ids=None, draft_encoder_tokens=None, mesh=None,
                rules=None, draft_rules=None) -> DecodeResult:
  """Speculative decoding of up to `max_decode_len` tokens per row (`Speculative(gamma, lenience)`).

  Both models implement the `Decoder` protocol and must share the vocabulary.
  gamma: draft tokens per target call. draft_encoder_tokens: the draft's own
  encoder input when it differs from the target's (another length or
  tokenization of the same vocabulary); default the same tokens.

  lenience: the paper's appendix A.5 (LOSSY). With l < 1 a draft token is
  accepted with probability min(1, p / (l q)) and rejections resample from
  norm(max(0, p - l q)): faster, but the output no longer follows the target's
  distribution. 1 (the default) is exact.
  rng, row_ids: as in `autoregressive` (per-row keys from (rng, row id, step)).

  mesh: run sharded on this `jax.sharding.Mesh` (as in `autoregressive`).
  The target is laid out by `rules` (default T5X's); the draft by
  `draft_rules`, default `partitioning.data_parallel_rules(rules)`: its
  parameters replicated on every device and only its batch sharded (a small
  draft's weights fit everywhere, and model-parallel collectives would cost
  more than its matmuls). Pass `draft_rules=rules` to shard it like the target.
  """
  return runner.run(Speculative(gamma=gamma, lenience=lenience), target, target_params,
                    encoder_tokens, draft=draft, draft_params=draft_params,
                    draft_encoder_tokens=draft_encoder_tokens, max_decode_len=max_decode_len,
                    sampling=sampling, rng=rng, row_ids=row_ids, mesh=mesh, rules=rules,
                    draft_rules=draft_rules)
