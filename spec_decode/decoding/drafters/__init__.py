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
`@registry.drafter("name")`; every module of this package is imported with it, so
the drafter is registered by name (and gin-configurable) without another edit.
The base class is in `base.py`.
"""

import importlib
import pkgutil

from spec_decode.decoding.drafters.base import Drafter

for _module in pkgutil.iter_modules(__path__):  # registration: every drafter module
  importlib.import_module(f"{__name__}.{_module.name}")

from spec_decode.decoding.drafters.adaptive import AdaptiveDrafter  # noqa: E402
from spec_decode.decoding.drafters.eagle import EagleDrafter, EagleTreeDrafter  # noqa: E402
from spec_decode.decoding.drafters.layer_skip import LayerSkipDrafter  # noqa: E402
from spec_decode.decoding.drafters.lookup import LookupDrafter, LookupTreeDrafter  # noqa: E402
from spec_decode.decoding.drafters.medusa import MedusaDrafter  # noqa: E402
from spec_decode.decoding.drafters.model import ModelDrafter  # noqa: E402
from spec_decode.decoding.drafters.mtp import MtpDrafter  # noqa: E402
from spec_decode.decoding.drafters.sampled_tree import SampledTreeDrafter  # noqa: E402
from spec_decode.decoding.drafters.tree import TreeDrafter  # noqa: E402

__all__ = ["AdaptiveDrafter", "Drafter", "EagleDrafter", "EagleTreeDrafter", "LayerSkipDrafter",
           "LookupDrafter", "LookupTreeDrafter", "MedusaDrafter", "ModelDrafter", "MtpDrafter",
           "SampledTreeDrafter", "TreeDrafter"]
