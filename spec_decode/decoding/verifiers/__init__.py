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
`@registry.verifier("name")`; every module of this package is imported with it, so
the verifier is registered by name (and gin-configurable) without another edit.
The base class is in `base.py`.
"""

import importlib
import pkgutil

from spec_decode.decoding.verifiers.base import Verifier

for _module in pkgutil.iter_modules(__path__):  # registration: every verifier module
  importlib.import_module(f"{__name__}.{_module.name}")

from spec_decode.decoding.verifiers.block import BlockVerifier  # noqa: E402
from spec_decode.decoding.verifiers.chain import ChainVerifier  # noqa: E402
from spec_decode.decoding.verifiers.tree import TreeVerifier  # noqa: E402
from spec_decode.decoding.verifiers.tree_rrs import TreeRRSVerifier  # noqa: E402

__all__ = ["Verifier", "BlockVerifier", "ChainVerifier", "TreeRRSVerifier", "TreeVerifier"]
