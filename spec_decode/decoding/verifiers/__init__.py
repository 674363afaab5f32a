"""Verifiers: turn the target's distributions and a proposal into accepted tokens.

  verify(p [B, K+1, V], proposal, accept_keys [B], correct_keys [B], *,
         sampling, lenience) -> Verdict

p[:, i] is the target's adjusted law after the committed prefix and the
proposal's first i tokens (for a tree: after node i - 1's path; p[:, 0] at
the root). A verifier must keep the output distributed exactly as the
target's (or say it is lossy: lenience < 1 is the paper's lenient variant).
A chain may propose fewer than K tokens in some rows (`proposal.proposed`):
positions at or past that length are padding, never accepted, and decisions
count only proposed positions.

Adding one: a new file here with a `Verifier` subclass under
`@registry.verifier("name")`, plus its import line below.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from spec_decode.decoding.types import Proposal, Verdict


@dataclasses.dataclass(frozen=True)
class Verifier:
  """Base class; see the module doc. supports_lenience: accepts lenience < 1."""
  supports_lenience: ClassVar[bool] = False
  chain_only: ClassVar[bool] = True
  # At temperature 0 (one-hot p and q) the verifier is exact matching of the chain
  # against the target's argmax; the loop then calls `greedy_verdict` and never
  # builds p. A verifier that decides otherwise at temperature 0 sets this False.
  greedy_is_matching: ClassVar[bool] = True

  def check_drafter(self, drafter) -> None:
    """Raises ValueError when this verifier is not exact for `drafter`'s proposals."""

  def verify(self, p, proposal: Proposal, accept_keys, correct_keys, *, sampling,
             lenience: float = 1.0) -> Verdict:
    raise NotImplementedError


from spec_decode.decoding.verifiers.chain import ChainVerifier  # noqa: E402  registration
from spec_decode.decoding.verifiers.tree import TreeVerifier  # noqa: E402  registration
from spec_decode.decoding.verifiers.block import BlockVerifier  # noqa: E402  registration
from spec_decode.decoding.verifiers.tree_rrs import TreeRRSVerifier  # noqa: E402  registration

__all__ = ["Verifier", "BlockVerifier", "ChainVerifier", "TreeRRSVerifier", "TreeVerifier"]
