"""Oracles of the draft-free drafters: source lookup (drafters/lookup.py) and self-speculation
from the target's first decoder layers (drafters/layer_skip.py), and of the verify call
trimmed to the longest proposal (`Speculative.trim_verify`).

* `lookup`: the longest n-gram wins, its first occurrence, continuations cut at the end of
  the source's real tokens or of the output so far, no match -> nothing, per row.
* `lookup_tree`: the best different matches' continuations, a longer n-gram's first,
  shared prefixes as one trie (siblings carry different tokens), the real nodes first and
  parents before children, nothing without a match, per row.
* Greedy identity with autoregressive decoding: lookup (alone, with the draft model or the
  target's first layer as its fallback, capped per n-gram size), the lookup tree (tree
  verifier) and layer skipping, with the chain and block verifiers, trimmed verify calls
  or not.
* Exactness: sequence-level chi-square against the target's enumerated law at t=1 and with
  top-k / top-p, each case checking the drafter really proposed and was accepted. Negative
  control: a lookup whose rows keep the draft model's q for the tokens it substituted (the
  mixing bug `ModelDrafter.propose(forced=...)` avoids) is rejected by the same test.
* No draft model: the runner and the experiment config ask for none, and refuse one;
  settings and model checks fail with clear errors.
"""

import dataclasses
import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from tiers import tiered
from spec_decode import decoding
from spec_decode.decoding import runner
from spec_decode.decoding.algorithms.speculative import verify_sizes
from spec_decode.decoding.drafters import layer_skip
from spec_decode.decoding.drafters.lookup import (LookupDrafter, LookupTreeDrafter, lookup,
                                                  lookup_tree)
from spec_decode.decoding.types import Proposal
from spec_decode.models import t5
from spec_decode.models.testing import MarkovDecoder

S = decoding.Sampling
CHAIN, BLOCK = decoding.ChainVerifier(), decoding.BlockVerifier()
TREE = decoding.TreeVerifier()
Skip = layer_skip.LayerSkipDrafter


def _lookup(source, output, m, num=4, **kw):
  tokens, length, ngram = lookup(jnp.asarray([source], jnp.int32),
                                 jnp.asarray([output], jnp.int32), jnp.asarray([m]), num=num,
                                 max_ngram=kw.pop("max_ngram", 3), **kw)
  return (np.asarray(tokens)[0, :int(length[0])].tolist(), int(ngram[0]))


# --------------------------------------------------------------------- lookup itself
def test_lookup_proposes_what_followed_the_output_in_the_source():
  src = [5, 6, 7, 8, 9, 1, 0, 0]  # EOS, then padding
  assert _lookup(src, [6, 7, 0, 0], 2) == ([8, 9, 1], 2)  # to the end of the real tokens
  assert _lookup(src, [6, 7, 0, 0], 2, num=2) == ([8, 9], 2)
  assert _lookup(src, [3, 4, 0, 0], 2) == ([], 0)  # no match: nothing
  assert _lookup(src, [1, 0, 0, 0], 1) == ([], 0)  # matched at the last real token
  assert _lookup(src, [0, 0, 0, 0], 0) == ([], 0)  # nothing committed yet
  # padding is never matched, even by an output token 0
  assert _lookup([5, 6, 0, 0, 0], [2, 0, 0, 0], 2, search_output=False) == ([], 0)


def test_longest_ngram_wins_then_its_first_occurrence():
  src = [3, 4, 9, 5, 4, 8, 5, 4, 7, 2]
  assert _lookup(src, [5, 4], 2) == ([8, 5, 4, 7], 2)  # "5 4" first at 3, not "4" at 1
  assert _lookup(src, [2, 4], 2) == ([9, 5, 4, 8], 1)  # only "4" matches: its first place
  assert _lookup(src, [9, 5, 4], 3) == ([8, 5, 4, 7], 3)
  assert _lookup(src, [9, 5, 4], 3, max_ngram=1) == ([9, 5, 4, 8], 1)
  assert _lookup(src, [2, 4], 2, min_ngram=2) == ([], 0)


def test_lookup_searches_the_output_so_far():
  src = [2, 3, 1]
  out = [7, 8, 9, 7, 8, 0, 0]
  assert _lookup(src, out, 5) == ([9, 7, 8], 2)  # up to the output's end, not past it
  assert _lookup(src, out, 5, search_output=False) == ([], 0)
  assert _lookup(src, out, 4) == ([8, 9, 7], 1)  # "7" at 0; the suffix itself never matches


def test_lookup_rows_are_independent():
  src = np.array([[5, 6, 7, 8, 1], [2, 2, 3, 1, 0]], np.int32)
  out = np.array([[6, 0, 0], [2, 2, 0]], np.int32)
  tokens, length, ngram = lookup(jnp.asarray(src), jnp.asarray(out), jnp.asarray([1, 2]),
                                 num=3, max_ngram=2)
  assert np.asarray(length).tolist() == [3, 2] and np.asarray(ngram).tolist() == [1, 2]
  assert np.asarray(tokens)[0].tolist() == [7, 8, 1]
  assert np.asarray(tokens)[1, :2].tolist() == [3, 1]


def test_tokens_per_ngram_caps_the_proposal():
  src = jnp.asarray([[3, 4, 9, 5, 4, 8, 5, 4, 7, 2]], jnp.int32)
  drafter = LookupDrafter(tokens_per_ngram=(1, 3))
  ctx = _ctx(src)

  def proposed(output, m):
    committed = decoding.Committed(tokens=jnp.asarray([output], jnp.int32),
                                   length=jnp.asarray([m]), it=jnp.int32(1))
    prop, _ = drafter.propose(ctx, drafter.init(ctx, 8), committed, None, 4)
    return np.asarray(prop.tokens)[0, :int(prop.length[0])].tolist()

  assert proposed([2, 4, 0], 2) == [9]  # a single-token match: at most 1
  assert proposed([5, 4, 0], 2) == [8, 5, 4]  # two or more tokens: at most 3


def _tree(source, output, m, width=2, depth=3, **kw):
  """(tokens, parents) of the real nodes of `lookup_tree`'s one-row tree, and its ngrams."""
  tokens, parent, ngram = lookup_tree(jnp.asarray([source], jnp.int32),
                                      jnp.asarray([output], jnp.int32), jnp.asarray([m]),
                                      width=width, depth=depth,
                                      max_ngram=kw.pop("max_ngram", 3), **kw)
  tokens, parent = np.asarray(tokens)[0], np.asarray(parent)[0]
  k = int(np.sum(parent >= -1))
  assert np.all(parent[k:] == -2)  # the real nodes first
  assert all(-1 <= parent[i] < i for i in range(k))  # parents first
  return tokens[:k].tolist(), parent[:k].tolist(), np.asarray(ngram)[0].tolist()


def _paths(tokens, parents):
  """Every root-to-leaf path of a tree, as token lists."""
  kids = {i: [j for j, p in enumerate(parents) if p == i] for i in range(-1, len(parents))}
  out = []

  def walk(i, path):
    if not kids[i]:
      out.append(path)
    for j in kids[i]:
      walk(j, path + [tokens[j]])
  walk(-1, [])
  return sorted(out)


def test_lookup_tree_holds_several_matches_continuations():
  src = [5, 6, 7, 8, 9, 6, 7, 4, 2, 1, 0, 0]
  tokens, parents, ngram = _tree(src, [6, 7, 0, 0], 2)
  assert _paths(tokens, parents) == [[4, 2, 1], [8, 9, 6]] and ngram == [2, 2]
  # the first branch is the chain lookup's proposal
  chain, length, _ = lookup(jnp.asarray([src]), jnp.asarray([[6, 7, 0, 0]]), jnp.asarray([2]),
                            num=3, max_ngram=3)
  assert tokens[0] == 8 and np.asarray(chain)[0, :int(length[0])].tolist() == [8, 9, 6]
  # a longer n-gram's match ranks first; a shorter one's fills the second branch
  tokens, parents, ngram = _tree([3, 7, 8, 5, 6, 7, 9, 1], [5, 6, 7], 3)
  assert ngram == [3, 1] and _paths(tokens, parents) == [[8, 5, 6], [9, 1]]
  assert tokens[0] == 9  # "5 6 7" -> 9 first


def test_lookup_tree_shares_prefixes_and_drops_repeats():
  # "6" is followed by "7 8 3" and by "7 8 4": one trie, branching at depth 3
  tokens, parents, _ = _tree([5, 6, 7, 8, 3, 6, 7, 8, 4, 1], [6, 0, 0, 0], 1)
  assert tokens == [7, 8, 3, 4] and parents == [-1, 0, 1, 1]
  # the same continuation twice is one branch; the next different one takes the other slot
  tokens, parents, _ = _tree([6, 7, 8, 6, 7, 8, 6, 9, 1], [6, 0], 1, depth=2)
  assert _paths(tokens, parents) == [[7, 8], [9, 1]]


def test_lookup_tree_without_a_match_is_empty_and_rows_are_independent():
  assert _tree([5, 6, 1, 0], [3, 0, 0], 1) == ([], [], [0, 0])
  assert _tree([5, 6, 1, 0], [0, 0, 0], 0) == ([], [], [0, 0])  # nothing committed yet
  src = np.array([[5, 6, 7, 8, 1], [2, 2, 3, 1, 0]], np.int32)
  out = np.array([[6, 0, 0], [3, 0, 0]], np.int32)
  tokens, parent, _ = lookup_tree(jnp.asarray(src), jnp.asarray(out), jnp.asarray([1, 1]),
                                  width=2, depth=2, max_ngram=2)
  assert np.asarray(tokens)[0, :2].tolist() == [7, 8] and np.asarray(parent)[0, :2].tolist() == [-1, 0]
  assert np.asarray(tokens)[1, :1].tolist() == [1] and np.asarray(parent)[1].tolist()[1:] == [-2] * 3


def _ctx(encoder_tokens):
  B = encoder_tokens.shape[0]
  return decoding.runner.LoopContext(
      target=None, target_params=None, draft=None, draft_params=None,
      encoder_tokens=encoder_tokens, draft_encoder_tokens=None, rng=jax.random.PRNGKey(0),
      row_ids=jnp.arange(B), max_decode_len=8, sampling=S())


def test_verify_sizes():
  assert verify_sizes(1) == (1, 2)
  assert verify_sizes(4) == (1, 2, 3, 5)
  assert verify_sizes(6) == (1, 2, 3, 5, 7)
  assert verify_sizes(8) == (1, 2, 3, 5, 9)


# ------------------------------------------------------------------- greedy identity
G_L, G_N = 12, 16


@functools.lru_cache(maxsize=None)
def _greedy_setup():
  """A tiny T5 target (2 decoder layers), a far draft, inputs whose tokens repeat (so the
  lookup matches), and the target's greedy outputs."""
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  tp = target.init(jax.random.PRNGKey(30))
  far = t5.T5(t5.T5Config.preset("t5_tiny", num_encoder_layers=1, num_decoder_layers=1))
  rs = np.random.RandomState(31)
  enc = rs.randint(2, 64, (G_N, 10)).astype(np.int32)
  for row, n in enumerate(rs.randint(1, 11, G_N)):
    enc[row, n:] = 0
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=G_L)
  return target, tp, (far, far.init(jax.random.PRNGKey(32))), enc, ar


GREEDY = {
    "lookup_chain": (LookupDrafter(), CHAIN, False, True),
    "lookup_block_untrimmed": (LookupDrafter(), BLOCK, False, False),
    "lookup_capped_chain": (LookupDrafter(tokens_per_ngram=(1, 4), max_ngram=2), CHAIN,
                            False, True),
    "lookup_fallback_model_block": (LookupDrafter(fallback=decoding.ModelDrafter()), BLOCK,
                                    True, True),
    "lookup_fallback_skip_chain": (LookupDrafter(fallback=Skip(layers=1)), CHAIN, False, True),
    "lookup_tree": (LookupTreeDrafter(), TREE, False, True),
    "lookup_tree_untrimmed_w3": (LookupTreeDrafter(width=3, depth=2), TREE, False, False),
    "skip_chain": (Skip(layers=1), CHAIN, False, True),
    "skip_block": (Skip(layers=1), BLOCK, False, True),
    "skip_chain_no_reuse": (Skip(layers=1, reuse=False), CHAIN, False, True),
}


@pytest.mark.parametrize("name", tiered(list(GREEDY), fast=("lookup_chain", "skip_chain",
                                                            "lookup_fallback_model_block",
                                                            "lookup_tree")))
def test_greedy_equals_autoregressive(name):
  drafter, verifier, with_draft, trim = GREEDY[name]
  target, tp, (dm, dp), enc, ar = _greedy_setup()
  algo = decoding.Speculative(gamma=4, drafter=drafter, verifier=verifier, trim_verify=trim)
  assert algo.needs_draft == with_draft
  drafts = dict(draft=dm, draft_params=dp) if with_draft else {}
  got = decoding.run(algo, target, tp, enc, max_decode_len=G_L, **drafts)
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
  st = got.stats
  assert int(np.sum(st.accepted)) > 0  # the drafter did propose, and was right sometimes
  assert int(np.sum(st.target_calls)) < int(np.sum(ar.stats.target_calls))
  assert len({tuple(r) for r in np.asarray(ar.tokens)}) > G_N // 2


@pytest.fixture
def verify_form(monkeypatch):
  """Sets `speculative.SWITCH_THROUGH_LOOPS` (read at trace time: caches cleared)."""
  def set_form(loops):
    monkeypatch.setattr(sys.modules[verify_sizes.__module__], "SWITCH_THROUGH_LOOPS", loops)
    jax.clear_caches()
  yield set_form
  jax.clear_caches()


@pytest.mark.parametrize("name", ["lookup_chain", "lookup_tree"])
def test_trimmed_verify_through_loops_equals_the_switch(name, verify_form):
  """The verify size chosen in while loops (the CPU default) and in a lax.switch give the
  same tokens and statistics, greedy and sampled with the same keys."""
  drafter, verifier, _, _ = GREEDY[name]
  target, tp, _, enc, _ = _greedy_setup()
  algo = decoding.Speculative(gamma=4, drafter=drafter, verifier=verifier)
  got = {}
  for loops in (True, False):
    verify_form(loops)
    for t in (0.0, 1.0):
      got[loops, t] = decoding.run(algo, target, tp, enc, max_decode_len=G_L,
                                   sampling=S(temperature=t), rng=jax.random.PRNGKey(3),
                                   row_ids=np.arange(G_N))
  for t in (0.0, 1.0):
    a, b = got[True, t], got[False, t]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for x, y in zip(jax.tree.leaves(a.stats), jax.tree.leaves(b.stats)):
      np.testing.assert_array_equal(x, y)
  assert len({int(n) for n in np.asarray(got[True, 0.0].stats.target_calls)}) > 1


def test_a_bad_switch_through_loops_setting_is_named(verify_form):
  target, tp, _, enc, _ = _greedy_setup()
  verify_form(1)
  with pytest.raises(ValueError, match="speculative.SWITCH_THROUGH_LOOPS must be None, True"):
    decoding.run(decoding.Speculative(gamma=4, drafter=LookupDrafter()), target, tp, enc,
                 max_decode_len=G_L)


def _loop_cache_copies(algo, target, tp, enc):
  """The copies of a whole self-attention K or V cache (G_L + gamma + 1 slots) in the
  compiled decoding program, outside its entry computation (where the caches are made)."""
  c = target.config
  text = runner._unsharded_jit(()).lower(
      tp, None, jnp.asarray(enc), None, jax.random.PRNGKey(0), np.arange(enc.shape[0]),
      algorithm=algo, target=target, draft=None, max_decode_len=G_L,
      sampling=S()).compile().as_text()
  B = enc.shape[0]
  copies, computation = [], None
  for line in text.splitlines():
    if line and not line.startswith(" "):
      computation = line.split(" ")[0]
    m = re.search(r"%[\w.-]+ = f32\[([\d,]+)\]\{[^}]*\} copy\(", line)
    if m and computation != "ENTRY" and sorted(int(d) for d in m.group(1).split(",")) == \
        sorted((B, c.num_heads, c.head_dim, G_L + algo.gamma + 1)):
      copies.append(line.strip()[:80])
  return copies


@pytest.mark.parametrize("B", [1, 4])
def test_trimmed_verify_through_loops_copies_no_cache(B, verify_form):
  """XLA gives a conditional's result a buffer of its own: with the verify size chosen in
  a lax.switch, every iteration copied each layer's K and V cache (the control below);
  through while loops, the cache stays in place."""
  target, tp, _, enc, _ = _greedy_setup()
  algo = decoding.Speculative(gamma=4, drafter=LookupDrafter())
  # The one-token call at batch 1 copies the caches with its dots (t5.ROWWISE_SELF_ATTENTION
  # is off by default): the rowwise form here, to see the conditional's copies alone.
  with t5.switched(ROWWISE_SELF_ATTENTION=True):
    verify_form(True)
    assert _loop_cache_copies(algo, target, tp, enc[:B]) == []
    verify_form(False)
    copies = _loop_cache_copies(algo, target, tp, enc[:B])
  assert len(copies) >= 2 * target.config.num_decoder_layers


def test_layer_skip_reuse_copies_no_cache_at_batch_1():
  """The verify call's one-token part (the first layers on the last proposed token) at
  batch 1: with dots XLA:CPU copies those layers' whole K and V caches in every iteration
  (the control below); in the rowwise form (`t5.REUSE_ROWWISE_SELF_ATTENTION`, the CPU's
  default) it copies none. The draft's own one-token steps in the rowwise form too, to see
  the verify call's copies alone."""
  target, tp, _, enc, _ = _greedy_setup()
  algo = decoding.Speculative(gamma=4, drafter=Skip(layers=1))
  with t5.switched(ROWWISE_SELF_ATTENTION=True):
    assert _loop_cache_copies(algo, target, tp, enc[:1]) == []
    with t5.switched(REUSE_ROWWISE_SELF_ATTENTION=False):
      assert len(_loop_cache_copies(algo, target, tp, enc[:1])) >= 2


# ------------------------------------------------------------------------ exactness
def _sample(algorithm, fam: str, sampling, *, rows: int, n_inputs: int, seed: int,
            draft: str | None = None):
  models, enc_all, L = ex.family(fam)
  target, tp = models["target"]
  drafts = {} if draft is None else dict(zip(("draft", "draft_params"), models[draft]))
  enc = np.repeat(enc_all[:n_inputs], rows // n_inputs, axis=0)
  result = decoding.run(algorithm, target, tp, enc, max_decode_len=L, sampling=sampling,
                        rng=jax.random.PRNGKey(seed), row_ids=np.arange(enc.shape[0]),
                        **drafts)
  seqs = ex.testing.sequences(result)
  per = len(seqs) // n_inputs
  return result, [seqs[g * per:(g + 1) * per] for g in range(n_inputs)]


@dataclasses.dataclass(frozen=True)
class KeepsDraftQ(LookupDrafter):
  """WRONG on purpose (negative control): a lookup with the draft model as fallback that
  substitutes its tokens in the rows that matched but leaves the draft model's q there (the
  verifier then takes the lookup's tokens as draws from q) and does not feed them to the
  draft model."""

  def propose(self, ctx, state, committed, keys, num):
    tokens, length, _ = lookup(ctx.encoder_tokens, committed.tokens, committed.length,
                               num=num, max_ngram=self.max_ngram, min_ngram=self.min_ngram,
                               search_output=self.search_output)
    other, state = self.fallback.propose(ctx, state, committed, keys, num)
    found = length > 0
    return Proposal.chain(jnp.where(found[:, None], tokens, other.tokens), other.q,
                          jnp.where(found, length, num)), state


# name: (family, sampling, gamma, drafter, verifier, draft, inputs, rows, seed)
CASES = {
    "lookup_chain_mk_t1_g3": ("mk", S(1.0), 3, LookupDrafter(), CHAIN, None, 3, ex.rows(6 / 5),
                              500),
    "lookup_block_mk_topk3_g4": ("mk", S(1.0, top_k=3), 4, LookupDrafter(max_ngram=2), BLOCK,
                                 None, 3, ex.rows(6 / 5), 501),
    "lookup_capped_chain_mk_t0.8_topp0.9_g3": (
        "mk", S(0.8, top_p=0.9), 3, LookupDrafter(tokens_per_ngram=(1, 3)), CHAIN, None, 1,
        ex.rows(), 502),
    "lookup_fallback_chain_mk_far_t1_g3": ("mk", S(1.0), 3,
                                           LookupDrafter(fallback=decoding.ModelDrafter()),
                                           CHAIN, "far", 1, ex.rows(), 503),
    "lookup_tree_mk_t1_g3": ("mk", S(1.0), 3, LookupTreeDrafter(), TREE, None, 3,
                             ex.rows(6 / 5), 506),
    "lookup_tree_w3_mk_topk3_g2": ("mk", S(1.0, top_k=3), 2, LookupTreeDrafter(width=3), TREE,
                                   None, 3, ex.rows(6 / 5), 507),
    "skip_chain_t5_t1_g3": ("t5", S(1.0), 3, Skip(layers=1), CHAIN, None, 1, ex.rows(2 / 3),
                            504),
    "skip_block_t5_topp0.9_g2": ("t5", S(1.0, top_p=0.9), 2, Skip(layers=1), BLOCK, None, 2,
                                 ex.rows(2 / 3), 505),
    "keeps_draft_q_chain_mk_far_t1_g3": ("mk", S(1.0), 3,
                                         KeepsDraftQ(fallback=decoding.ModelDrafter()), CHAIN,
                                         "far", 1, ex.rows(), 503),
}


@functools.lru_cache(maxsize=None)
def _run(name):
  fam, sampling, gamma, drafter, verifier, draft, n_inputs, rows, seed = CASES[name]
  algo = decoding.Speculative(gamma=gamma, drafter=drafter, verifier=verifier)
  result, groups = _sample(algo, fam, sampling, rows=rows, n_inputs=n_inputs, seed=seed,
                           draft=draft)
  return result, groups, ex.target_laws(fam, n_inputs, sampling)


@pytest.mark.parametrize("name", tiered([n for n in CASES if not n.startswith("keeps")],
                                        fast=("lookup_chain_mk_t1_g3", "skip_chain_t5_t1_g3",
                                              "lookup_tree_mk_t1_g3")))
def test_draft_free_drafters_are_exact(name):
  result, groups, laws = _run(name)
  st = result.stats
  drafted = float(np.sum(st.draft_tokens) / np.sum(st.target_calls))
  fit = ex.fit(f"{name} (drafted per call {drafted:.2f})", groups, laws)
  assert fit.impossible == 0
  assert fit.p_value >= ex.P_REJECT, fit
  assert drafted > 0.2 and int(np.sum(st.accepted)) > 0  # it did propose, and was accepted


@pytest.mark.slow
def test_negative_control_a_lookup_keeping_the_draft_q_is_rejected():
  result, groups, laws = _run("keeps_draft_q_chain_mk_far_t1_g3")
  fit = ex.fit("lookup keeping the draft's q (negative control)", groups, laws)
  assert fit.p_value < ex.P_REJECT, fit


# ------------------------------------------------------------- no draft model, errors
def test_the_draft_free_drafters_take_no_draft_model():
  target, tp, (dm, dp), enc, _ = _greedy_setup()
  for drafter, verifier in ((LookupDrafter(), CHAIN), (Skip(layers=1), CHAIN),
                            (LookupDrafter(fallback=Skip(layers=1)), CHAIN),
                            (LookupTreeDrafter(), TREE)):
    algo = decoding.Speculative(gamma=2, drafter=drafter, verifier=verifier)
    assert not algo.needs_draft
    with pytest.raises(ValueError, match="uses no draft model"):
      decoding.run(algo, target, tp, enc, draft=dm, draft_params=dp, max_decode_len=4)
  with pytest.raises(ValueError, match="needs a draft model"):
    decoding.run(decoding.Speculative(gamma=2, drafter=LookupDrafter(
        fallback=decoding.ModelDrafter())), target, tp, enc, max_decode_len=4)


def test_layer_skip_needs_a_deeper_t5_target():
  target, tp, _, enc, _ = _greedy_setup()
  with pytest.raises(ValueError, match="below the target's 2 decoder layers"):
    decoding.run(decoding.Speculative(gamma=2, drafter=Skip(layers=2)), target, tp, enc,
                 max_decode_len=4)
  markov = MarkovDecoder(6, order=1)
  with pytest.raises(ValueError, match="T5 target"):
    decoding.run(decoding.Speculative(gamma=2, drafter=Skip(layers=1)), markov,
                 markov.init(jax.random.PRNGKey(0)), ex.MK_ENC, max_decode_len=4)


def test_layer_skip_reads_the_targets_own_weights():
  target, tp, _, _, _ = _greedy_setup()
  shallow = layer_skip.truncated(target, 1)
  sub = layer_skip.truncated_params(tp, 1)
  assert shallow.config.num_decoder_layers == 1
  assert sorted(sub["decoder"]) == sorted(n for n in tp["decoder"] if n != "layers_1")
  assert sub["decoder"]["layers_0"] is tp["decoder"]["layers_0"]
  assert sub["encoder"] is tp["encoder"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_ngram=0), "max_ngram"), (dict(min_ngram=3, max_ngram=2), "min_ngram 3"),
    (dict(search_output=1), "search_output"), (dict(tokens_per_ngram=()), "tokens_per_ngram"),
    (dict(tokens_per_ngram=(2, -1)), "tokens_per_ngram"),
    (dict(fallback=decoding.AdaptiveDrafter()), "fallback"),
    (dict(fallback=decoding.ModelDrafter), "fallback")])
def test_bad_lookup_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LookupDrafter(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(width=0), "width"), (dict(depth=0), "depth"), (dict(depth=2.5), "depth"),
    (dict(max_ngram=True), "max_ngram"), (dict(min_ngram=4), "min_ngram 4"),
    (dict(search_output="yes"), "search_output")])
def test_bad_lookup_tree_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LookupTreeDrafter(**kwargs)


def test_lookup_tree_needs_a_tree_verifier():
  with pytest.raises(ValueError, match="proposes trees but ChainVerifier verifies chains"):
    decoding.Speculative(gamma=2, drafter=LookupTreeDrafter())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_layer_skip_settings(bad):
  with pytest.raises(ValueError, match="layers"):
    Skip(layers=bad)


def test_bad_layer_skip_reuse_setting():
  with pytest.raises(ValueError, match="LayerSkipDrafter.reuse must be True or False"):
    Skip(reuse=1)


# ------------------------------------------------- the verify call reusing the draft's work
def _three_layers():
  """A 3-decoder-layer T5, its params, an encoding of 2 rows, and a cache holding 3 and 2
  tokens (rows at different lengths)."""
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny", num_decoder_layers=3))
  params = model.init(jax.random.PRNGKey(40))
  enc = jnp.asarray(np.random.RandomState(41).randint(2, 60, (2, 7)), jnp.int32)
  encoded = model.encode(params, enc)
  cache = model.decode(params, model.init_cache(params, encoded, 16),
                       jnp.asarray([[0, 5, 6], [0, 7, 9]], jnp.int32)).cache
  return model, params, encoded, cache.rewind(jnp.asarray([3, 2], jnp.int32))


def _drafted(model, params, encoded, cache, tokens, k):
  """The truncated model fed tokens[:, :-1] one at a time from the target cache's first k
  layers, as the layer skip drafts: (streams after layer k - 1, its cache)."""
  shallow = layer_skip.truncated(model, k)
  sp = layer_skip.truncated_params(params, k)
  dc = shallow.init_cache(sp, encoded, cache.max_length).replace(
      self_k=cache.self_k[:k], self_v=cache.self_v[:k], lengths=cache.lengths)
  streams = []
  for j in range(tokens.shape[1] - 1):
    out = shallow.decode(sp, dc, tokens[:, j:j + 1], layers=(k - 1,))
    dc = out.cache
    streams.append(out.features)
  return jnp.concatenate(streams, axis=1), dc


@pytest.mark.parametrize("k", [1, 2])
def test_decode_reusing_equals_decode(k):
  """The verify call from the draft's first k layers gives decode's logits, states and
  caches (up to float rounding: those layers ran one token at a time), lengths + T; and it
  does read the streams it is given: zeroed streams change every logit but the last
  position's... which still differs through the deeper layers' attention."""
  model, params, encoded, cache = _three_layers()
  tokens = jnp.asarray([[4, 8, 9, 10, 11], [12, 13, 3, 2, 5]], jnp.int32)
  want = model.decode(params, cache, tokens)
  streams, dc = _drafted(model, params, encoded, cache, tokens, k)
  got = model.decode_reusing(params, cache, tokens, streams=streams, shallow_k=dc.self_k,
                             shallow_v=dc.self_v)
  np.testing.assert_allclose(got.logits, want.logits, atol=2e-5)
  np.testing.assert_allclose(got.hidden, want.hidden, atol=2e-5)
  np.testing.assert_array_equal(got.cache.lengths, [8, 7])
  for name in ("self_k", "self_v"):
    for a, b in zip(getattr(got.cache, name), getattr(want.cache, name)):
      np.testing.assert_allclose(a, b, atol=2e-5)
  zeroed = model.decode_reusing(params, cache, tokens, streams=0 * streams,
                                shallow_k=dc.self_k, shallow_v=dc.self_v)
  assert np.min(np.max(np.abs(np.asarray(zeroed.logits - want.logits)), axis=-1)) > 1e-2


def test_decode_reusing_refuses_bad_shapes():
  model, params, encoded, cache = _three_layers()
  tokens = jnp.asarray([[4, 8, 9], [12, 13, 3]], jnp.int32)
  streams, dc = _drafted(model, params, encoded, cache, tokens, 1)
  with pytest.raises(ValueError, match=r"streams must be \[B, T - 1, D\]"):
    model.decode_reusing(params, cache, tokens, streams=streams[:, :1], shallow_k=dc.self_k,
                         shallow_v=dc.self_v)
  with pytest.raises(ValueError, match="must cover the same 1 .. 2 first decoder layers"):
    model.decode_reusing(params, cache, tokens, streams=streams, shallow_k=cache.self_k,
                         shallow_v=cache.self_v)


@pytest.mark.parametrize("reuse", [True, False])
def test_layer_skip_hands_its_streams_to_the_verify_call(reuse):
  """With reuse, a proposal carries the draft's streams at s_m and the proposed tokens but
  the last ([B, K, D]) and the drafter makes the verify call; without, neither."""
  model, params, encoded, cache = _three_layers()
  drafter = Skip(layers=2, reuse=reuse)
  enc = jnp.asarray(np.random.RandomState(41).randint(2, 60, (2, 7)), jnp.int32)
  ctx = runner.LoopContext(target=model, target_params=params, draft=None, draft_params=None,
                           encoder_tokens=enc, draft_encoder_tokens=enc,
                           rng=jax.random.PRNGKey(0), row_ids=jnp.arange(2, dtype=jnp.int32),
                           max_decode_len=16, sampling=S()).with_target_encoded()
  # rows as the cache holds them (s_1 .., then s_m: 8 and 9), the draft's cache as the loop
  # leaves it: the target's first layers' entries of s_0 .. s_{m-1}
  tokens = np.zeros((2, 16), np.int32)
  tokens[0, :3], tokens[1, :2] = [5, 6, 8], [7, 9]
  committed = decoding.Committed(tokens=jnp.asarray(tokens),
                                 length=jnp.asarray([3, 2], jnp.int32), it=jnp.int32(1))
  state = drafter.init(ctx, 16).replace(self_k=cache.self_k[:2], self_v=cache.self_v[:2],
                                        lengths=cache.lengths)
  keys = jax.vmap(lambda k: jax.random.split(k, 3))(ctx.keys(0))
  proposal, state = drafter.propose(ctx, state, committed, keys, 3)
  target_in = jnp.concatenate([committed.token_at(committed.length)[:, None],
                               proposal.tokens], axis=1)
  out = drafter.verify_call(ctx, state, cache, target_in, proposal)
  if not reuse:
    assert proposal.states is None and out is None
    return
  assert proposal.states.shape == (2, 3, model.config.emb_dim)
  np.testing.assert_allclose(out.logits, model.decode(params, cache, target_in).logits,
                             atol=2e-5)


def test_bad_trim_verify():
  with pytest.raises(ValueError, match="trim_verify"):
    decoding.Speculative(gamma=2, drafter=LookupDrafter(), trim_verify=1)


def test_lookup_predicts_from_its_mean_proposed_length():
  d = LookupDrafter()
  full = d.expected_tokens(alpha=0.5, gamma=4)
  assert full == pytest.approx((1 - 0.5 ** 5) / 0.5)
  half = d.expected_tokens(alpha=0.5, gamma=4,
                           counters={"draft_tokens": 20, "target_calls": 10})
  assert half == pytest.approx((1 - 0.5 ** 3) / 0.5)
  assert d.expected_tokens(alpha=1.0, gamma=4, counters={"draft_tokens": 5,
                                                         "target_calls": 10}) == 1.5
