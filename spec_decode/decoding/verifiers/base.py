"""The `Verifier` base class: the capabilities the speculative loop reads, and `verify`.

See the package doc (`spec_decode.decoding.verifiers`) for what `verify` receives.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from spec_decode.decoding.types import Proposal, Verdict


@dataclasses.dataclass(frozen=True)
class Verifier:
  """Base class of every verifier.

  supports_lenience: accepts lenience < 1 (the paper's lossy variant).
  chain_only: verifies chains only (a drafter proposing trees needs one that is not).
  greedy_is_matching: at temperature 0 (one-hot p and q) the verifier is exact matching
  of the chain against the target's argmax; the loop then calls `greedy_verdict` and
  never builds p. A verifier that decides otherwise at temperature 0 sets this False.
  """
  supports_lenience: ClassVar[bool] = False
  chain_only: ClassVar[bool] = True
  greedy_is_matching: ClassVar[bool] = True

  def check_drafter(self, drafter) -> None:
    """Raises ValueError when this verifier is not exact for `drafter`'s proposals."""

  def verify(self, p, proposal: Proposal, accept_keys, correct_keys, *, sampling,
             lenience: float = 1.0) -> Verdict:
    raise NotImplementedError
