"""In-loop refill (`decoding.run(..., refill_batch=B)`, `runner.refilling_loop`): a dataset
decoded in B slots, each finished row's slot taken by the next row inside the jitted loop.

Oracles: every row's tokens, length and counters equal the plain batched decode's (greedy
and sampled for the autoregressive and speculative decoders, sampled for the adaptive (per-row
draft length) ones; rows of different lengths so that slots refill at different iterations); a
refilled row equals that row decoded alone with its row id (batch composition, entry time
and the slot's previous row do not matter); the sampled sequence law with refilled rows
passes the chi-square oracle (tests/exactness.py); bad settings are refused by name.
"""

import jax
import numpy as np
import pytest

import exactness as ex
from tiers import tiered
from spec_decode import decoding
from spec_decode.decoding.drafters.eagle import EagleDrafter, EagleTreeDrafter
from spec_decode.decoding.drafters.lookup import LookupDrafter
from spec_decode.decoding.drafters.model import ModelDrafter
from spec_decode.decoding.drafters.mtp import MtpDrafter
from spec_decode.heads import eagle, mtp

N, S, L = 9, 7, 10
GREEDY, SAMPLED = decoding.Sampling(), decoding.Sampling(temperature=1.0)
ALGOS = {"autoregressive": decoding.Autoregressive(), "speculative": decoding.Speculative(gamma=3),
         # per-row draft lengths (item 3 of the throughput issue): a refilled row starts
         # from the drafter's initial state, not from its slot's previous row's
         "adaptive_schedule": decoding.Speculative(
             gamma=4, drafter=decoding.AdaptiveDrafter(rule="schedule", start=1)),
         "adaptive_tuned": decoding.Speculative(
             gamma=4, drafter=decoding.AdaptiveDrafter(rule="tuned", threshold=0.9))}


def _inputs():
  rs = np.random.RandomState(3)
  enc = rs.randint(2, 32, (N, S)).astype(np.int32)
  enc[rs.rand(N, S) < 0.25] = 0  # padding here and there: rows of different lengths
  return enc


def _run(algo, enc, sampling, **kw):
  target, tp, draft, dp = ex.t5_eos_pair()
  extra = dict(draft=draft, draft_params=dp) if algo.needs_draft else {}
  return decoding.run(algo, target, tp, enc, max_decode_len=L, sampling=sampling,
                      rng=jax.random.PRNGKey(7), **extra, **kw)


def _assert_same(a, b, rows=slice(None)):
  np.testing.assert_array_equal(np.asarray(a.tokens)[rows], np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.lengths)[rows], np.asarray(b.lengths))
  for name, value in b.stats.counters.items():
    got, want = np.asarray(a.stats.counters[name])[rows], np.asarray(value)
    if np.issubdtype(want.dtype, np.integer):
      np.testing.assert_array_equal(got, want, err_msg=name)
    else:  # a float sum's last bits may differ with the batch shape XLA reduces over
      np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)


# Greedy for the two decoders whose verdict has a greedy path of its own; the adaptive
# drafters' refill (a slot's new row starts from the drafter's initial state) does not depend
# on how the verifier decides, so they run sampled only (each case compiles three loops).
_EQUALS_CASES = [(name, sampling) for name in sorted(ALGOS) for sampling in ("greedy", "sampled")
                 if sampling == "sampled" or name in ("autoregressive", "speculative")]


@pytest.mark.parametrize("name, sampling", tiered(
    _EQUALS_CASES, fast=[f"{n}-{s}" for n in ("autoregressive", "speculative")
                         for s in ("greedy", "sampled")],
    ids=[f"{n}-{s}" for n, s in _EQUALS_CASES]))
def test_refill_equals_batched_decode(name, sampling):
  sampling = {"greedy": GREEDY, "sampled": SAMPLED}[sampling]
  enc = _inputs()
  plain = _run(ALGOS[name], enc, sampling)
  lengths = np.asarray(plain.lengths)
  assert len(set(lengths.tolist())) > 1, "rows must end at different lengths"
  for slots in (1, 4):
    _assert_same(_run(ALGOS[name], enc, sampling, refill_batch=slots), plain)


def test_one_chunk_of_slots_equals_batched_decode():
  """refill_batch >= the rows: one chunk, nothing waits, finished slots are only retired."""
  enc = _inputs()
  _assert_same(_run(ALGOS["speculative"], enc, SAMPLED, refill_batch=2 * N),
               _run(ALGOS["speculative"], enc, SAMPLED))


@pytest.mark.parametrize("name", tiered(sorted(ALGOS), fast=("autoregressive", "speculative",
                                                              "adaptive_schedule")))
def test_refilled_row_equals_the_row_alone(name):
  """Row 6 enters slot-refilled (after rows of other lengths finished) and decodes what it
  decodes alone under its own row id, sampled."""
  enc = _inputs()
  refilled = _run(ALGOS[name], enc, SAMPLED, refill_batch=2)
  alone = _run(ALGOS[name], enc[6:7], SAMPLED, row_ids=np.array([6]))
  _assert_same(refilled, alone, rows=slice(6, 7))


def test_sequence_law_with_refilled_rows():
  """Sampled with 64 slots over many rows of one input: every slot is refilled hundreds of
  times, and the sequence law still matches the target's exactly."""
  models, enc_all, max_len = ex.family("mk")
  (target, tp), (draft, dp) = models["target"], models["far"]
  rows = ex.rows(1 / 3)
  enc = np.repeat(enc_all[:1], rows, axis=0)
  result = decoding.run(decoding.Speculative(gamma=2), target, tp, enc, draft=draft,
                        draft_params=dp, max_decode_len=max_len, sampling=SAMPLED,
                        rng=jax.random.PRNGKey(0), row_ids=np.arange(rows), refill_batch=64)
  from spec_decode.models import testing
  fit = ex.fit("refill, mk far", [testing.sequences(result)], ex.target_laws("mk", 1, SAMPLED))
  assert fit.p_value > ex.P_REJECT


@pytest.mark.parametrize("kwargs, match", [
    (dict(refill_batch=0), "refill_batch must be a positive int"),
    (dict(refill_batch=2.0), "refill_batch must be a positive int"),
])
def test_bad_refill_batch(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _run(ALGOS["autoregressive"], _inputs(), GREEDY, **kwargs)


class _SharedIterationDrafter(ModelDrafter):
  """A plug-in that says its state is not all per row."""
  refillable = False


def test_refill_refuses_compaction_and_shared_iteration_drafters():
  with pytest.raises(ValueError, match="exclude each other"):
    _run(decoding.Autoregressive(compact_batch=True), _inputs(), GREEDY, refill_batch=2)
  with pytest.raises(ValueError, match="_SharedIterationDrafter branches on the loop's shared"):
    decoding.Speculative(drafter=_SharedIterationDrafter()).check_refill()
  with pytest.raises(ValueError, match="_SharedIterationDrafter"):  # wrapped as a fallback
    decoding.Speculative(
        drafter=LookupDrafter(fallback=_SharedIterationDrafter())).check_refill()
  for drafter in (LookupDrafter(), EagleDrafter(), MtpDrafter()):
    decoding.Speculative(drafter=drafter).check_refill()  # per-row state: refillable
  decoding.Speculative(drafter=EagleTreeDrafter(budget=6, depth=3),
                       verifier=decoding.TreeVerifier()).check_refill()


def _head(name: str, target):
  """(algorithm, head, params): a random feature-level head reading `target`."""
  if name == "mtp":
    head = mtp.MtpModules(mtp.MtpConfig.for_target(target.config, num_modules=3))
    return decoding.Speculative(gamma=3, drafter=MtpDrafter()), head, head.init(
        jax.random.PRNGKey(5))
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config,
                                                     start_feature=name == "eagle_start"))
  algo = (decoding.Speculative(gamma=3, drafter=EagleDrafter()) if name.startswith("eagle_s")
          or name == "eagle" else
          decoding.Speculative(gamma=3, drafter=EagleTreeDrafter(budget=6, depth=3, steps=3),
                               verifier=decoding.TreeVerifier()))
  return algo, head, head.init(jax.random.PRNGKey(5))


@pytest.mark.parametrize("name, sampling", tiered(
    [("eagle", GREEDY), ("eagle", SAMPLED), ("eagle_tree", SAMPLED), ("mtp", SAMPLED),
     ("eagle_start", SAMPLED)],
    fast=("eagle-sampled",),
    ids=["eagle-greedy", "eagle-sampled", "eagle_tree-sampled", "mtp-sampled",
         "eagle_start-sampled"]))
def test_refill_with_feature_heads(name, sampling):
  """EAGLE (chain and tree) and MTP heads propose nothing on a row's first iteration, which
  is per row (nothing committed yet), and an EAGLE head with a learned start predicts the
  entering row's f_0 from its own encoder output (`EagleDrafter.init` of the entering
  rows), so a refilled slot starts its new row as a fresh batch does: every row equals
  the plain batched decode, and a refilled row equals the row decoded alone."""
  target, tp, _, _ = ex.t5_eos_pair()
  algo, head, hp = _head(name, target)
  enc = _inputs()
  run = lambda enc, **kw: decoding.run(algo, target, tp, enc, draft=head, draft_params=hp,
                                       max_decode_len=L, sampling=sampling,
                                       rng=jax.random.PRNGKey(7), **kw)
  refilled = run(enc, refill_batch=2)
  _assert_same(refilled, run(enc))
  _assert_same(refilled, run(enc[6:7], row_ids=np.array([6])), rows=slice(6, 7))
