"""Drafters: what proposes tokens for the target to verify.

A drafter is a small frozen dataclass with three methods called inside the
speculative loop's jit:

  init(ctx, room) -> state                      its state (e.g. the draft model's cache)
  propose(ctx, state, committed, keys, num) -> (Proposal, state)
      propose up to `num` tokens after the committed ones (keys [B, num]
      per-row PRNG keys), with their draft distributions q when sampled
  commit(ctx, state, committed, verdict, proposal) -> state
      after verification (`committed` holds the new tokens and, as
      `target_hidden`, the target's final decoder states from the verify call)

`ctx.encode("target")` inside `init` returns the target's encoder output that
the target cache was built from (computed once per decode call).

Adding one: a new file here with a `Drafter` subclass under
`@registry.drafter("name")`, plus its import line below.
"""

from __future__ import annotations

import dataclasses

from spec_decode.decoding.types import Committed, Proposal, Verdict


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class; see the module doc. proposes_trees: whether proposals may branch.
  reports_confidence: whether proposals carry `Proposal.confidence` (the speculative
  loop then counts `draft_mass_at`)."""
  proposes_trees = False
  reports_confidence = False

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


from spec_decode.decoding.drafters.model import ModelDrafter  # noqa: E402  registration
from spec_decode.decoding.drafters.tree import TreeDrafter  # noqa: E402  registration
from spec_decode.decoding.drafters.adaptive import AdaptiveDrafter  # noqa: E402  registration
from spec_decode.decoding.drafters.medusa import MedusaDrafter  # noqa: E402  registration
from spec_decode.decoding.drafters.sampled_tree import SampledTreeDrafter  # noqa: E402
from spec_decode.decoding.drafters.eagle import EagleDrafter, EagleTreeDrafter  # noqa: E402
from spec_decode.decoding.drafters.mtp import MtpDrafter  # noqa: E402  registration

__all__ = ["AdaptiveDrafter", "Drafter", "EagleDrafter", "EagleTreeDrafter", "MedusaDrafter",
           "ModelDrafter", "MtpDrafter", "SampledTreeDrafter", "TreeDrafter"]
