"""Self-speculation: the target's own first k decoder layers and its LM head draft (layer
skipping, as in Draft & Verify); no draft model.

The draft is the target truncated after decoder layer k - 1: the same embedding, encoder
output, first k decoder blocks, final norm and LM head, reading the target's own parameters
(no copy). It runs as the draft model of `ModelDrafter` does (a 2-token catch-up call, then
one token per call), with its own cache of k layers (the cross-attention K/V of those
layers are computed once per decode call from the target's encoder output, which the loop
computes once for both). The target then verifies as for any chain draft, so every verifier
that is exact for a sampled chain keeps the target's distribution exactly.

With `reuse` (the default) the verify call does not compute the first k layers twice: the
draft's calls return their residual streams after layer k - 1 (`Proposal.states`, at s_m and
the proposed tokens but the last), the verify call (`T5.decode_reusing`) copies the
draft cache's K/V of those positions into the target's first k layers, runs those layers on
the last proposed token only, and layers k .. on all gamma + 1 positions from the streams.
What is skipped is the first k layers' work on gamma tokens; on a memory-bound step (one
row on a CPU) that is little, as the weights are read either way; at batch or on
compute-bound hardware it is up to k / L of the verify call's layer work. The target's
probabilities are the same function of the same parameters (their first layers ran in
the draft's calls: equal up to float rounding), so every exact verifier stays exact. The
cost model (`Speculative.cost_model`) still charges the verify call as `target.decode`'s:
with reuse it over-charges by what reuse saves (`experiments/shallow_reuse.py` measures it).

Cost: a draft step reads k of the target's L decoder layers plus its LM head, so
c ~ (k x layer + head) / (L x layer + head); the target's weights are shared, no memory is
added beyond the draft's cache. Acceptance: what the first k layers of a model trained
only at its last layer predict through the final norm and LM head (measured by
experiments/draft_free.py).

With `adapter=True` the decode call's draft model is a trained exit adapter
(`heads.exit_adapter`, Kangaroo): one decoder block of the target's layer shape, trained on
the frozen target to read its layer-k stream, runs after the first k layers, before the final
norm and LM head. The draft is then a T5 of k + 1 layers (the target's first k, the adapter)
and runs the same loop; a draft step costs one more layer than plain layer skipping.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from spec_decode.decoding import registry, timing
from spec_decode.decoding.drafters.model import ModelDrafter
from spec_decode.decoding.runner import is_int
from spec_decode.models import t5


@runtime_checkable
class ExitAdapterLike(Protocol):
  """What `LayerSkipDrafter(adapter=True)` asks of its draft "model" (`heads.exit_adapter.
  ExitAdapter`): a block trained to run after the target's first `layers` decoder layers."""
  layers: int

  def check_target(self, target) -> None:
    """Raises ValueError unless the adapter fits after this target's first layers."""

  def draft(self, target) -> t5.T5:
    """The draft: a T5 of the target's settings, its first layers and the adapter."""

  def draft_params(self, target_params, params):
    """The draft's parameters: the target's first layers' (the same leaves), the adapter's."""


def truncated(target, layers: int) -> t5.T5:
  """`target` cut after its first `layers` decoder layers (a T5 of the same settings)."""
  return dataclasses.replace(target, config=target.config.replace(num_decoder_layers=layers))


def truncated_params(params, layers: int):
  """The target's `params` (plain or laid out for decoding) without decoder layers
  `layers` .. : the same leaves, no copy."""
  keep = lambda name: not (name.startswith("layers_") and int(name[len("layers_"):]) >= layers)
  return {**params, "decoder": {n: v for n, v in params["decoder"].items() if keep(n)}}


@registry.drafter("layer_skip")
@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(ModelDrafter):
  """Proposes a chain from the target's first `layers` decoder layers (module doc); with
  `adapter`, through the exit adapter the decode call is given as its draft model."""
  layers: int = 2
  adapter: bool = False
  reuse: bool = True

  def __post_init__(self):
    if not is_int(self.layers) or self.layers < 1:
      raise ValueError(f"LayerSkipDrafter.layers must be an int >= 1, got {self.layers!r}")
    for name in ("adapter", "reuse"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"LayerSkipDrafter.{name} must be True or False, got "
                         f"{getattr(self, name)!r}")

  @property
  def needs_draft_model(self) -> bool:  # overrides the class attribute: the adapter
    return self.adapter

  def check_models(self, target, draft) -> None:
    if not isinstance(target, t5.T5):
      raise ValueError(f"LayerSkipDrafter drafts with a T5 target's own layers, got a "
                       f"{type(target).__name__} target")
    n = target.config.num_decoder_layers
    if self.layers >= n:
      raise ValueError(f"LayerSkipDrafter.layers = {self.layers} must be below the target's "
                       f"{n} decoder layers (the draft is the target's first layers)")
    if not self.adapter:
      return
    if not isinstance(draft, ExitAdapterLike):
      raise ValueError(f"LayerSkipDrafter(adapter=True) drafts through an exit adapter "
                       f"(heads.exit_adapter, ModelSpec kind 'exit_adapter'), got a "
                       f"{type(draft).__name__} draft")
    if draft.layers != self.layers:
      raise ValueError(f"the exit adapter was trained after {draft.layers} decoder layers, "
                       f"LayerSkipDrafter.layers is {self.layers}")
    draft.check_target(target)

  def _shallow(self, target, target_params, draft, draft_params):
    """(model, params) of the draft: the truncated target, or with an adapter the target's
    first layers and the adapter (laid out like the target)."""
    if self.adapter:
      return draft.draft(target), draft.draft_params(target_params, draft_params)
    return truncated(target, self.layers), truncated_params(target_params, self.layers)

  def _draft_ctx(self, ctx):
    """`ctx` with the truncated target as its draft model (laid out like the target)."""
    model, params = self._shallow(ctx.target, ctx.target_params, ctx.draft, ctx.draft_params)
    return dataclasses.replace(
        ctx, draft=model, draft_params=params, draft_encoder_tokens=ctx.encoder_tokens,
        draft_rules=ctx.rules, draft_packed_index=ctx.packed_index)

  def init(self, ctx, room: int):
    ctx = self._draft_ctx(ctx)
    return ctx.constrain_cache(ctx.draft.init_cache(ctx.draft_params, ctx.encode("target"),
                                                    room), "draft")

  def propose(self, ctx, cache, committed, keys_BK, num: int, forced=None):
    return super().propose(self._draft_ctx(ctx), cache, committed, keys_BK, num, forced=forced)

  def _decode(self, ctx, cache, tokens):
    """The draft's call; with `reuse`, also its residual stream after layer k - 1 (the
    target's layer-k input) as `features`, for `verify_call`."""
    if not self.reuse:
      return super()._decode(ctx, cache, tokens)
    return ctx.draft.decode(ctx.draft_params, cache, tokens, layers=(self.layers - 1,))

  def verify_call(self, ctx, state, target_cache, target_in, proposal):
    """With `reuse`: the target's call from the draft's first-layer work
    (`T5.decode_reusing`; `state` is the draft's cache after the proposal, holding s_m and
    the proposed tokens but the last at the target cache's next slots)."""
    if not self.reuse or proposal.states is None:
      return None
    k = self.layers
    return ctx.target.decode_reusing(ctx.target_params, target_cache, target_in,
                                     streams=proposal.states, shallow_k=state.self_k[:k],
                                     shallow_v=state.self_v[:k])

  def proposal_loop(self, workload: timing.Workload, *, gamma: int, steps: int,
                    verify_tokens: int = 0):
    """gamma single-token steps of the truncated target per proposal (see ModelDrafter);
    with verify_tokens, this drafter's own proposals each followed by a target call."""
    if verify_tokens:
      return timing.proposal_loop(self, workload, gamma=gamma, steps=steps,
                                  verify_tokens=verify_tokens)
    model, params = self._shallow(workload.target, workload.target_params, workload.draft,
                                  workload.draft_params)
    shallow = dataclasses.replace(workload, draft=model, draft_params=params,
                                  draft_rules=workload.rules)
    return super().proposal_loop(shallow, gamma=gamma, steps=steps)
