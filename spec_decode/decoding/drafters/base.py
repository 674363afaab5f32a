"""The `Drafter` base class: what the speculative loop and the verifiers may ask of a drafter.

See the package doc (`spec_decode.decoding.drafters`) for the three loop methods. A
drafter also says what it costs and what it is expected to yield, for the cost model
of `Speculative` and the experiments' measurements:

  proposal_loop(workload, gamma, steps)   its proposals in a jitted loop, for the shared
                                          loop timer (`timing.interleaved`); with
                                          verify_tokens, each followed by a verify call
  proposal_seconds(workload, gamma)       the marginal seconds of one proposal
  expected_tokens(alpha, gamma, counters) E[tokens per target call], or None
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, ClassVar, Mapping

import jax.numpy as jnp

from spec_decode import theory
from spec_decode.decoding import timing
from spec_decode.decoding.types import Committed, Proposal, Verdict


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class of every drafter: capabilities the loop and verifiers read, and the loop's
  three methods (`init`, `propose`, `commit`).

  proposes_trees: whether proposals may branch (a tree verifier is then required).
  reports_confidence: whether proposals carry `Proposal.confidence` (the speculative
  loop then counts `draft_mass_at`).
  sibling_draws: how a sampled tree draws a node's children, 'with_replacement' or
  'without_replacement'; None for chains and deterministic trees (a verifier whose rule
  depends on it checks it: `TreeRRSVerifier`).
  needs_draft_model: whether the decode call must be given a draft model (`ctx.draft`); a
  draft-free drafter (source lookup, the target's own layers) says False, and the
  speculative loop then runs with the target alone.
  refillable: whether a row's drafter state is all per row (batch first), so a refilling
  loop (`runner.refilling_loop`) can give a finished row's slot to the next example; a
  drafter that branches on the loop's shared iteration count (`Committed.it`) says False
  (a row's own first iteration is `Committed.length == 0`, which refill keeps per row).
  varies_length: whether a proposal's length often falls short of gamma (a lookup that
  matched nothing proposes none); the speculative loop then verifies only as many
  positions as the longest row proposed (`Speculative.trim_verify`), at the price of a
  compiled verify call per size; such a tree lists its real nodes first.
  """
  needs_draft_model: ClassVar[bool] = True
  varies_length: ClassVar[bool] = False
  proposes_trees: ClassVar[bool] = False
  reports_confidence: ClassVar[bool] = False
  sibling_draws: ClassVar[str | None] = None
  refillable: ClassVar[bool] = True

  def proposal_size(self, gamma: int) -> int:
    """K, the most tokens one proposal holds (a chain: gamma)."""
    return gamma

  def max_gamma(self, draft) -> int | None:
    """The longest proposal this drafter can make with `draft` (its MTP modules, its
    Medusa heads), or None where only the decode length bounds it (the default)."""
    return None

  def check_models(self, target, draft) -> None:
    """Raises ValueError when the models cannot serve this drafter."""

  def target_layers(self, draft) -> tuple[int, ...]:
    """Target decoder layers whose residual streams `commit` reads beside the final states
    (`Committed.target_hidden`); () for none (the default)."""
    return ()

  def init(self, ctx, room: int):
    raise NotImplementedError

  def propose(self, ctx, state, committed: Committed, keys, num: int) -> tuple[Proposal, object]:
    raise NotImplementedError

  def verify_call(self, ctx, state, target_cache, target_in, proposal: Proposal):
    """The target's verify call on target_in [B, K + 1] ([s_m, the chain]) made cheaper
    from what `propose` computed (its returned `state` and `Proposal.states`), or None
    (the default): the loop then calls `target.decode`. The result must be what that call
    returns up to float rounding (the layer skip's `T5.decode_reusing`). Asked for chain
    verifiers only, and only of a drafter that names no `target_layers`."""
    return None

  def commit(self, ctx, state, committed: Committed, verdict: Verdict, proposal: Proposal):
    return state

  # ------------------------------------------------------------------ cost and yield
  def proposal_loop(self, workload: timing.Workload, *, gamma: int, steps: int,
                    verify_tokens: int = 0):
    """A zero-argument function running `steps` proposals of gamma tokens in one jit (its
    `.steps` is `steps`), for the shared loop timer: by default this drafter's own
    `propose` (`timing.proposal_loop`); with verify_tokens n, each followed by a target call
    on n tokens (the proposal's cost where the decoding loop runs it)."""
    return timing.proposal_loop(self, workload, gamma=gamma, steps=steps,
                                verify_tokens=verify_tokens)

  def proposal_seconds(self, workload: timing.Workload, *, gamma: int, steps: int = 8,
                       repeats: int = 10) -> float:
    """Seconds of one proposal of gamma tokens inside a jitted loop: the median over
    `repeats` rounds of the marginal cost of one more (`timing.interleaved`)."""
    pair = timing.marginal_pair(
        lambda k: self.proposal_loop(workload, gamma=gamma, steps=k), steps)
    return statistics.median(timing.interleaved({"proposal": pair}, repeats=repeats)
                             ["proposal"])

  def expected_tokens(self, *, alpha: float, gamma: int,
                      counters: Mapping[str, Any] | None = None) -> float | None:
    """E[tokens per target call] of this drafter at acceptance rate alpha (None: it makes
    no prediction). A chain of K = `proposal_size(gamma)` tokens: Thm 3.8's
    (1 - alpha^(K+1)) / (1 - alpha). counters: the decoder's named counters summed over
    the rows (`DecodeStats`), for drafters that predict from their own statistics."""
    if self.proposes_trees:
      return None  # a tree's yield is no function of alpha
    return float(theory.expected_tokens(alpha, self.proposal_size(gamma)))


@dataclasses.dataclass(frozen=True)
class FixedProposal(Drafter):
  """Proposes the same chain every call and runs no model: a timing aid, not a decoder's
  drafter. In a proposal loop with a verify call (`proposal_loop(verify_tokens=n)`) it
  leaves the loop's verify call and bookkeeping alone, in the same jitted loop as a
  drafter's, so the difference of the two loops is what that drafter's proposal adds where
  the decoding loop runs it (`experiment.measure.step_costs(in_loop=True)`). The tokens (3
  or 4, by the committed length's parity) depend on the loop's state, so nothing is hoisted
  out of the loop; their values change no cost."""

  def init(self, ctx, room: int):
    return ()

  def propose(self, ctx, state, committed: Committed, keys, num: int):
    B = committed.length.shape[0]
    tokens = jnp.full((B, num), 3, jnp.int32) + committed.length[:, None] % 2
    return Proposal.chain(tokens), state
