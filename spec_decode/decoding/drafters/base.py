"""The `Drafter` base class: what the speculative loop and the verifiers may ask of a drafter.

See the package doc (`spec_decode.decoding.drafters`) for the three loop methods.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

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
  """
  proposes_trees: ClassVar[bool] = False
  reports_confidence: ClassVar[bool] = False
  sibling_draws: ClassVar[str | None] = None

  def proposal_size(self, gamma: int) -> int:
    """K, the most tokens one proposal holds (a chain: gamma)."""
    return gamma

  def check_models(self, target, draft) -> None:
    """Raises ValueError when the models cannot serve this drafter."""

  def init(self, ctx, room: int):
    raise NotImplementedError

  def propose(self, ctx, state, committed: Committed, keys, num: int) -> tuple[Proposal, object]:
    raise NotImplementedError

  def commit(self, ctx, state, committed: Committed, verdict: Verdict, proposal: Proposal):
    return state
