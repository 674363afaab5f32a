"""Shared by the exactness oracles of verifiers and drafters (test_block_verification.py,
test_adaptive.py, test_tree.py, test_tree_rrs.py): tiny models whose every output
sequence can be enumerated, one speculative run per case over a large batch of
independent rows, and the sequence-level chi-square test of
tests/test_speculative.py (same P_REJECT).

Rows are independent samples because each row's keys derive from (rng, row id,
step) only; row group g (a block of consecutive rows) decodes encoder input g.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from spec_decode import decoding
from spec_decode.models import t5, testing
from spec_decode.models.testing import MarkovDecoder

P_REJECT = 1e-3  # chi-square significance: exactness fails, a negative control passes, below it
# The oracles' sample size, their one setting: every sequence-law case samples rows(k) =
# k x ROWS independent rows (whole output sequences): k 1 for one Markov input, 2/3 for the
# T5 family's smaller laws and the head drafters, 6/5 for three inputs, 4/3 or 5/3 where a
# negative control needs the power to be rejected, 1/10 or 2/15 for the n-gram and Medusa
# smoke laws. The slow tier runs them all; the fast tier one small case per
# verifier and drafter family.
ROWS = 30_000


def rows(k: float = 1.0) -> int:
  """k x ROWS rows, a whole number."""
  return int(round(k * ROWS))

MK_V, MK_L = 6, 4
MK_ENC = np.array([[3, 4, 5, 0], [2, 2, 0, 0], [5, 1, 4, 3]], np.int32)
T5_V, T5_L = 7, 3
T5_ENC = np.array([[3, 4, 5, 2, 6, 0, 0], [2, 6, 3, 3, 5, 4, 2]], np.int32)


@functools.lru_cache(maxsize=None)
def markov_models():
  """Order-2 target; drafts: far (order 1), close (perturbed target), identical, uniform
  (order 1 with zero logits: the same model as far, so the two share compilations)."""
  target = MarkovDecoder(MK_V, order=2)
  tp = target.init(jax.random.PRNGKey(10), scale=1.5)
  far = MarkovDecoder(MK_V, order=1)
  zeros = jax.numpy.zeros((MK_V, MK_V), jax.numpy.float32)
  return {"target": (target, tp),
          "far": (far, far.init(jax.random.PRNGKey(11))),
          "uniform": (far, {"table": zeros, "source": zeros}),
          "close": (target, testing.perturbed(tp, 12, 0.3)),
          "same": (target, tp)}


@functools.lru_cache(maxsize=None)
def t5_models():
  """T5.1.1 tiny target (vocab 7) and a far draft (T5 1.0, one layer each side)."""
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=T5_V))
  far = t5.T5(t5.T5Config.preset("t5_tiny", vocab_size=T5_V, num_encoder_layers=1,
                                 num_decoder_layers=1))
  return {"target": (target, target.init(jax.random.PRNGKey(0))),
          "far": (far, far.init(jax.random.PRNGKey(1)))}


@functools.lru_cache(maxsize=None)
def t5_eos_pair():
  """(target, params, draft, params): T5 tiny pair, vocab 32, EOS made likely enough to end
  some rows inside a draft tree (for greedy identity tests of tree decoders)."""
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=32))
  draft = t5.T5(t5.T5Config.preset("t5_tiny", vocab_size=32, num_decoder_layers=1))
  tp = target.init(jax.random.PRNGKey(0))
  dense = tp["decoder"]["logits_dense"]["kernel"]
  tp["decoder"]["logits_dense"]["kernel"] = dense.at[:, t5.EOS_ID].multiply(3.0)
  return target, tp, draft, draft.init(jax.random.PRNGKey(1))


def family(name: str):
  """(models, all encoder inputs, max_decode_len) of 'mk' (Markov) or 't5'."""
  return (markov_models(), MK_ENC, MK_L) if name == "mk" else (t5_models(), T5_ENC, T5_L)


@functools.lru_cache(maxsize=None)
def target_laws(fam: str, n_inputs: int, sampling: decoding.Sampling):
  """The target's exact sequence law for each of the first n_inputs encoder inputs."""
  models, enc, L = family(fam)
  return testing.sequence_distribution(*models["target"], enc[:n_inputs], max_decode_len=L,
                                       sampling=sampling)


def sample(algorithm, fam: str, draft: str, sampling: decoding.Sampling, *, rows: int,
           n_inputs: int = 1, seed: int = 0):
  """(result, per-input groups of sampled sequences) of one speculative run."""
  models, enc_all, L = family(fam)
  (target, tp), (dmodel, dp) = models["target"], models[draft]
  enc = np.repeat(enc_all[:n_inputs], rows // n_inputs, axis=0)
  result = decoding.run(algorithm, target, tp, enc, draft=dmodel, draft_params=dp,
                        max_decode_len=L, sampling=sampling, rng=jax.random.PRNGKey(seed),
                        row_ids=np.arange(enc.shape[0]))
  seqs = testing.sequences(result)
  per = len(seqs) // n_inputs
  return result, [seqs[g * per:(g + 1) * per] for g in range(n_inputs)]


def fit(label: str, groups, laws) -> testing.GoodnessOfFit:
  out = testing.chi_square(groups, laws)
  print(f"\n[exactness] {label}: n={out.samples} chi2={out.statistic:.1f} dof={out.dof} "
        f"p={out.p_value:.4g} tv={out.tv:.4f} impossible={out.impossible}")
  return out


def head_law_fit(algorithm, make_draft, label: str, *, rows: int = rows(2 / 3),
                 n_inputs: int = 2,
                 sampling: decoding.Sampling = decoding.Sampling(temperature=1.0)):
  """(fit, result): the sequence law of `algorithm` on the t5 family's target with the draft
  make_draft(target) -> (draft, params) (a head reading the target), against the exact law."""
  models, enc_all, max_len = family("t5")
  target, tp = models["target"]
  draft, dp = make_draft(target)
  enc = np.repeat(enc_all[:n_inputs], rows // n_inputs, axis=0)
  result = decoding.run(algorithm, target, tp, enc, draft=draft, draft_params=dp,
                        max_decode_len=max_len, sampling=sampling, rng=jax.random.PRNGKey(0),
                        row_ids=np.arange(rows))
  seqs = testing.sequences(result)
  per = len(seqs) // n_inputs
  groups = [seqs[g * per:(g + 1) * per] for g in range(n_inputs)]
  return fit(label, groups, target_laws("t5", n_inputs, sampling)), result
