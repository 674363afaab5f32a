"""Batch compaction (`compact_batch=True`): the loops shrink their batch as rows finish.

Markov test doubles compute every distribution exactly whatever the batch shape, so a
compacted decode must reproduce the plain decode bit for bit: tokens, lengths and every
counter, sampled or greedy, autoregressive or speculative.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiers import tiered
from spec_decode import decoding
from spec_decode.decoding import runner
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.types import Proposal
from spec_decode.models.testing import MarkovDecoder

V, L, B = 6, 12, 13  # 13 rows: stages of 13, 7, 4, 2, 1 (odd sizes round up)


@pytest.fixture(scope="module")
def models():
  """An order-2 Markov target whose EOS logit is raised by 3, so greedy and sampled rows
  end at different lengths (5 to 12 of L = 12 greedy), and an order-1 draft."""
  target = MarkovDecoder(V, order=2)
  draft = MarkovDecoder(V, order=1)
  tp = dict(target.init(jax.random.PRNGKey(0), scale=1.5))
  tp["table"] = np.asarray(tp["table"]).copy()
  tp["table"][..., 1] += 3.0
  enc = np.random.RandomState(0).randint(2, V, (B, 5)).astype(np.int32)
  return target, tp, draft, draft.init(jax.random.PRNGKey(1)), enc


def _assert_same(plain, compacted):
  np.testing.assert_array_equal(np.asarray(compacted.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(compacted.lengths), np.asarray(plain.lengths))
  assert compacted.stats.names == plain.stats.names
  for name in plain.stats.names:
    np.testing.assert_array_equal(np.asarray(compacted.stats.counters[name]),
                                  np.asarray(plain.stats.counters[name]), err_msg=name)


def test_compaction_sizes():
  assert runner.compaction_sizes(1) == (1,)
  assert runner.compaction_sizes(8) == (8, 4, 2, 1)
  assert runner.compaction_sizes(13) == (13, 7, 4, 2, 1)


@pytest.mark.parametrize("temperature", tiered([0.0, 0.8], fast=(0.0,)))
def test_compacted_decoders_equal_plain_ones(models, temperature):
  target, tp, draft, dp, enc = models
  kw = dict(max_decode_len=L, sampling=decoding.Sampling(temperature=temperature),
            rng=jax.random.PRNGKey(2))
  for algo, extra in ((decoding.Autoregressive, {}),
                      (lambda **k: decoding.Speculative(gamma=3, **k),
                       dict(draft=draft, draft_params=dp))):
    plain = decoding.run(algo(), target, tp, enc, **extra, **kw)
    compacted = decoding.run(algo(compact_batch=True), target, tp, enc, **extra, **kw)
    lengths = np.asarray(plain.lengths)
    # Rows finish at different lengths, so the later stages run (with few rows).
    assert len(set(lengths.tolist())) >= 3 and lengths.min() < L, lengths
    _assert_same(plain, compacted)


@pytest.mark.slow
def test_compacted_row_equals_row_decoded_alone(models):
  """Keys follow (rng, row id, step) through the gathers: a row's output is its own."""
  target, tp, draft, dp, enc = models
  kw = dict(draft=draft, draft_params=dp, max_decode_len=L,
            sampling=decoding.Sampling(temperature=1.0), rng=jax.random.PRNGKey(3))
  algo = decoding.Speculative(gamma=2, compact_batch=True)
  batch = decoding.run(algo, target, tp, enc, **kw)
  for i in (0, 6, B - 1):
    alone = decoding.run(decoding.Speculative(gamma=2), target, tp, enc[i:i + 1],
                         row_ids=np.array([i]), **kw)
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[i])
    np.testing.assert_array_equal(np.asarray(alone.stats.accepted)[0],
                                  np.asarray(batch.stats.accepted)[i])


def test_compaction_refuses_what_it_cannot_gather(models):
  target, tp, draft, dp, enc = models

  @dataclasses.dataclass(frozen=True)
  class ScalarStateDrafter(Drafter):
    """Proposes token 2 always; its state is a scalar (no batch axis to gather)."""

    def init(self, ctx, room):
      return jnp.zeros((), jnp.int32)

    def propose(self, ctx, state, committed, keys, num):
      return Proposal.chain(jnp.full((ctx.batch_size, num), 2, jnp.int32)), state + 1

  algo = decoding.Speculative(gamma=2, drafter=ScalarStateDrafter(), compact_batch=True)
  with pytest.raises(ValueError, match=r"batch first.*\.draft has shape \(\)"):
    decoding.run(algo, target, tp, enc, draft=draft, draft_params=dp, max_decode_len=L)
  with pytest.raises(ValueError, match="compact_batch must be True or False"):
    decoding.Autoregressive(compact_batch=1)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with pytest.raises(ValueError, match=r"compact_batch=True\) runs unsharded only"):
    decoding.run(decoding.Autoregressive(compact_batch=True), target, tp, enc,
                 max_decode_len=L, mesh=mesh)
