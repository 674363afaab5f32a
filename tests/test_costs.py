"""What drafters cost and yield: `Drafter.proposal_loop` / `proposal_seconds` (every drafter
times its own proposal with the shared loop timer), `Drafter.expected_tokens` and the
`Speculative.cost_model` built on them (a tree predicts its own yield, not a chain's), and
the experiment runner's step costs (`experiment.step_costs`)."""

import functools
import types

import jax
import numpy as np
import pytest

from spec_decode import decoding, experiment, theory
from spec_decode.decoding import timing
from spec_decode.experiment import report
from spec_decode.heads import eagle, medusa, mtp
from spec_decode.models import t5

V, L = 32, 8


@functools.lru_cache(maxsize=None)
def _models():
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=V))
  draft = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=V, num_decoder_layers=1))
  heads = {
      "eagle": eagle.EagleHead(eagle.EagleConfig.for_target(target.config)),
      "medusa": medusa.MedusaHeads(medusa.MedusaConfig.for_target(target, 3)),
      "mtp": mtp.MtpModules(mtp.MtpConfig.for_target(target.config, num_modules=3))}
  params = {"eagle": heads["eagle"].init(jax.random.PRNGKey(2)), "medusa": heads["medusa"].init(),
            "mtp": heads["mtp"].init(jax.random.PRNGKey(3))}
  enc = np.random.RandomState(0).randint(2, V, (2, 6)).astype(np.int32)
  return (target, target.init(jax.random.PRNGKey(0)), draft, draft.init(jax.random.PRNGKey(1)),
          heads, params, enc)


def _workload(kind: str, temperature: float = 0.0) -> timing.Workload:
  target, tp, draft, dp, heads, hp, enc = _models()
  if kind == "none":  # a draft-free drafter: the target alone
    d, p = None, None
  else:
    d, p = (draft, dp) if kind == "model" else (heads[kind], hp[kind])
  return timing.Workload(target=target, target_params=tp, encoder_tokens=enc,
                         cache_length=L + 9, position=L // 2, draft=d, draft_params=p,
                         sampling=decoding.Sampling(temperature=temperature))


DRAFTERS = [("model", decoding.ModelDrafter()),
            ("model", decoding.TreeDrafter(budget=4, depth=3)),
            ("model", decoding.SampledTreeDrafter(width=2, depth=2)),
            ("eagle", decoding.EagleDrafter()),
            ("eagle", decoding.EagleTreeDrafter(budget=4, depth=3)),
            ("medusa", decoding.MedusaDrafter()), ("mtp", decoding.MtpDrafter()),
            ("none", decoding.LookupDrafter()), ("none", decoding.LayerSkipDrafter(layers=1))]


@pytest.mark.slow
@pytest.mark.parametrize("kind,drafter", DRAFTERS, ids=[type(d).__name__ for _, d in DRAFTERS])
def test_every_drafter_times_its_own_proposal(kind, drafter, monkeypatch):
  """proposal_seconds times the drafter's own proposal loop as a marginal pair (steps and
  twice as many) with the shared timer and returns the median of its rounds; the clock is
  replaced by fixed round values, so nothing here depends on how fast the machine is."""
  temperature = 1.0 if isinstance(drafter, decoding.SampledTreeDrafter) else 0.0
  w = _workload(kind, temperature)
  loop = drafter.proposal_loop(w, gamma=2, steps=2)
  assert loop.steps == 2
  jax.block_until_ready(loop())
  seen = {}

  def fake_interleaved(loops, *, repeats):
    (name, pair), = loops.items()
    seen.update(name=name, steps=tuple(f.steps for f in pair), repeats=repeats)
    for f in pair:
      jax.block_until_ready(f())  # the loops the timer would run, run once
    return {name: [0.3, 0.1, 0.2]}

  monkeypatch.setattr(timing, "interleaved", fake_interleaved)
  assert drafter.proposal_seconds(w, gamma=2, steps=2, repeats=3) == 0.2
  assert seen == {"name": "proposal", "steps": (2, 4), "repeats": 3}


def test_expected_tokens_of_chains_and_trees():
  alpha = 0.7
  for d in (decoding.ModelDrafter(), decoding.AdaptiveDrafter(), decoding.EagleDrafter(),
            decoding.MedusaDrafter(), decoding.MtpDrafter()):
    assert d.expected_tokens(alpha=alpha, gamma=4) == pytest.approx(
        float(theory.expected_tokens(alpha, 4)))
  tree = decoding.TreeDrafter(budget=3, depth=3)
  counters = {"target_calls": 10, "draft_mass_at": [8.0, 5.0, 2.0]}
  assert tree.expected_tokens(alpha=alpha, gamma=4, counters=counters) == pytest.approx(2.5)
  assert tree.expected_tokens(alpha=alpha, gamma=4) is None  # no confidences counted
  assert decoding.SampledTreeDrafter().expected_tokens(alpha=alpha, gamma=4) is None


def test_cost_model_of_a_chain_is_thm_3_8_and_a_tree_predicts_its_own_yield():
  alpha, gamma, c, ratio = 0.8, 5, 0.1, 1.7
  chain = decoding.Speculative(gamma=gamma).cost_model(alpha=alpha, draft_cost=gamma * c,
                                                       verify_ratio=ratio)
  assert chain["thm_3_8"] == pytest.approx(float(theory.walltime_improvement(alpha, gamma, c)))
  assert chain["cost_model"] == pytest.approx(
      float(theory.cost_model_improvement(alpha, gamma, c, {gamma + 1: ratio})))
  assert chain["optimal_gamma"] == int(theory.optimal_gamma(alpha, c))
  tree = decoding.Speculative(drafter=decoding.TreeDrafter(budget=4, depth=3),
                              verifier=decoding.TreeVerifier())
  counters = {"target_calls": 4, "draft_mass_at": [4.0, 2.0, 2.0, 0.0]}
  model = tree.cost_model(alpha=alpha, draft_cost=3.0, verify_ratio=2.0, counters=counters)
  assert model["expected_tokens"] == pytest.approx(3.0)  # not the chain's E[tokens](0.8, 4)
  assert model["cost_model"] == pytest.approx(3.0 / 5.0) and model["optimal_gamma"] is None
  sampled = decoding.Speculative(drafter=decoding.SampledTreeDrafter(),
                                 verifier=decoding.TreeRRSVerifier())
  assert sampled.cost_model(alpha=alpha, draft_cost=1.0, verify_ratio=1.0) is None
  assert decoding.Autoregressive().cost_model(alpha=alpha, draft_cost=1.0,
                                              verify_ratio=1.0) is None


def test_report_charges_each_decoder_its_own_proposal():
  chain = decoding.Speculative(gamma=2)
  tree = decoding.Speculative(drafter=decoding.TreeDrafter(budget=4, depth=3),
                              verifier=decoding.TreeVerifier())
  cfg = types.SimpleNamespace(algorithms={"autoregressive": decoding.Autoregressive(),
                                          "chain": chain, "tree": tree},
                              baseline_name="autoregressive")
  stats = {"target_calls": 2, "draft_tokens": 4, "accepted": 3, "decisions": 4,
           "min_pq_sum": 3.2, "accepted_at": [2, 1, 0, 0], "decided_at": [2, 2, 0, 0]}
  row = {"decoders": {"autoregressive": {"stats": {"target_calls": 5}, "length": 5,
                                         "tokens": [3, 4, 5, 6, 1]},
                      "chain": {"stats": dict(stats, accepted_at=[2, 1], decided_at=[2, 2]),
                                "length": 5, "tokens": [3, 4, 5, 6, 1]},
                      "tree": {"stats": dict(stats, draft_mass_at=[2.0, 1.0, 1.0, 0.0]),
                               "length": 5, "tokens": [3, 4, 5, 6, 1]}}}
  steps = {"target_step_seconds": 0.01, "proposal_seconds": {"chain": 0.004, "tree": 0.03},
           "c_by_decoder": {"chain": 0.2, "tree": 0.75},
           "verify_ratio_by_tokens": {"3": 1.5, "5": 2.0}}
  seconds = {"autoregressive": 1.0, "chain": 0.5, "tree": 0.8}
  d = {n: report._decoder_summary(cfg, n, [row], seconds, steps) for n in ("chain", "tree")}
  assert d["chain"]["cost_model_speedup"] == pytest.approx(
      float(theory.expected_tokens(0.8, 2)) / (0.4 + 1.5))
  assert d["tree"]["expected_tokens_per_call"] == pytest.approx(1 + 4.0 / 2)
  assert d["tree"]["cost_model_speedup"] == pytest.approx(3.0 / (3.0 + 2.0))
  assert d["chain"]["c"] == 0.2 and d["tree"]["c"] == 0.75


@pytest.mark.slow
def test_step_costs_time_every_decoder_in_the_same_rounds():
  w = _workload("model")
  _, _, _, _, heads, hp, _ = _models()
  decoders = {"ar": decoding.Autoregressive(), "chain": decoding.Speculative(gamma=2),
              "medusa": decoding.Speculative(gamma=2, drafter=decoding.MedusaDrafter())}
  costs = experiment.step_costs(w, decoders, drafts={"medusa": (heads["medusa"], hp["medusa"])},
                                verify_tokens=(2,), repeats=2, steps=2)
  assert set(costs["proposal"]) == set(costs["c"]) == set(costs["c_rounds"]) == {"chain",
                                                                                 "medusa"}
  assert set(costs["verify_ratio"]) == set(costs["verify"]) == {2, 3}
  t_p = costs["target_step"]["median"]
  assert t_p > 0 and costs["target_step"]["n"] == 2
  for name in ("chain", "medusa"):  # c: the medians' ratio, per drafted token
    assert costs["c"][name] == costs["proposal"][name]["median"] / (2 * t_p) > 0
    assert costs["c_rounds"][name]["n"] == 2
  assert costs["verify_ratio"][3] == costs["verify"][3]["median"] / t_p


IN_LOOP_DRAFTERS = [("model", decoding.ModelDrafter()), ("none", decoding.LookupDrafter()),
                    ("none", decoding.LayerSkipDrafter(layers=1)),
                    ("eagle", decoding.EagleDrafter())]


@pytest.mark.parametrize("kind,drafter", IN_LOOP_DRAFTERS,
                         ids=[type(d).__name__ for _, d in IN_LOOP_DRAFTERS])
def test_proposal_loops_with_a_verify_call_run_the_drafters_own_proposals(kind, drafter):
  """proposal_loop(verify_tokens=n): the drafter's own proposals, each followed by a target
  call on n tokens, in one jitted loop; the same settings share a compile."""
  w = _workload(kind)
  loop = drafter.proposal_loop(w, gamma=2, steps=2, verify_tokens=3)
  assert loop.steps == 2
  assert np.isfinite(float(jax.block_until_ready(loop())))
  with pytest.raises(ValueError, match="verify_tokens must be an int >= 0"):
    timing.proposal_loop(drafter, w, gamma=2, steps=2, verify_tokens=-1)


def test_in_loop_costs_subtract_the_verify_call(monkeypatch):
  """step_costs(in_loop=True): c_in_loop = (proposal + verify loop - the same loop with a
  fixed proposal) / (gamma T_p) per round, the median over rounds, at least the proposal's
  c alone (the clock replaced by fixed values: what is checked is the arithmetic and which
  loops are built and run, not the machine's speed)."""
  w = _workload("model")
  decoders = {"ar": decoding.Autoregressive(), "chain": decoding.Speculative(gamma=2),
              "skip": decoding.Speculative(gamma=3,
                                           drafter=decoding.LayerSkipDrafter(layers=1))}
  # Three rounds. The chain's per-round differences are 0.005, 0.005 and 0.008 (median 0.005);
  # the difference of the two loops' medians would be 0.021 - 0.015 = 0.006.
  fixed = {"target": [0.010, 0.010, 0.010], "proposal:chain": [0.004, 0.004, 0.004],
           "fixed+verify:chain": [0.015, 0.035, 0.013],
           "proposal+verify:chain": [0.020, 0.040, 0.021],
           "proposal:skip": [0.006, 0.006, 0.006], "fixed+verify:skip": [0.016, 0.016, 0.016],
           "proposal+verify:skip": [0.010, 0.010, 0.010],
           "verify:3": [0.009, 0.009, 0.009], "verify:4": [0.001, 0.001, 0.001]}

  def fake_interleaved(loops, *, repeats, inner):
    assert list(loops) == list(fixed)  # each loop with a fixed proposal right before its own
    for name, pair in loops.items():
      for f in pair:
        jax.block_until_ready(f())  # every loop the timer would run builds and runs
    return fixed

  monkeypatch.setattr(timing, "interleaved", fake_interleaved)
  costs = experiment.step_costs(w, decoders, repeats=2, steps=1, in_loop=True)
  assert costs["c"]["chain"] == pytest.approx(0.004 / (2 * 0.010))
  assert costs["c_in_loop"]["chain"] == pytest.approx((0.020 - 0.015) / (2 * 0.010))
  # The skip decoder's loop with its verify call read less than the verify call alone (noise):
  # its in-loop c is its c alone, not 0 (a draft that costs nothing would pick a huge gamma).
  assert costs["c"]["skip"] == pytest.approx(0.006 / (3 * 0.010))
  assert costs["c_in_loop"]["skip"] == pytest.approx(costs["c"]["skip"])
  assert costs["proposal_in_loop"]["chain"]["median"] == pytest.approx(0.021)


def test_report_charges_the_in_loop_cost_when_measured():
  chain = decoding.Speculative(gamma=2)
  cfg = types.SimpleNamespace(algorithms={"autoregressive": decoding.Autoregressive(),
                                          "chain": chain}, baseline_name="autoregressive")
  stats = {"target_calls": 2, "draft_tokens": 4, "accepted": 3, "decisions": 4,
           "min_pq_sum": 3.2, "accepted_at": [2, 1], "decided_at": [2, 2]}
  row = {"decoders": {"autoregressive": {"stats": {"target_calls": 5}, "length": 5,
                                         "tokens": [3, 4, 5, 6, 1]},
                      "chain": {"stats": stats, "length": 5, "tokens": [3, 4, 5, 6, 1]}}}
  steps = {"target_step_seconds": 0.01, "proposal_seconds": {"chain": 0.004},
           "c_by_decoder": {"chain": 0.2}, "c_in_loop_by_decoder": {"chain": 0.35},
           "verify_ratio_by_tokens": {"3": 1.5}}
  d = report._decoder_summary(cfg, "chain", [row], {"autoregressive": 1.0, "chain": 0.5}, steps)
  assert d["cost_model_speedup"] == pytest.approx(
      float(theory.expected_tokens(0.8, 2)) / (2 * 0.35 + 1.5))
  assert d["c"] == 0.2 and d["c_in_loop"] == 0.35


def test_in_loop_costs_are_refused_for_sharded_runs():
  import dataclasses
  w = dataclasses.replace(_workload("model"), mesh=object())  # never reached: refused first
  with pytest.raises(ValueError, match="unsharded runs only"):
    experiment.step_costs(w, {"chain": decoding.Speculative(gamma=2)}, repeats=1,
                          in_loop=True)


def test_interleaved_alternates_the_order_when_asked():
  """alternate=True reverses the loops' order every other round (an A/B's second loop of a
  round can lose to the first); by default every round runs them in the given order."""
  calls = []

  def loop(name):
    def f():
      calls.append(name)
      return np.zeros(())
    f.steps = 1
    return f

  for alternate, want in ((False, list("abab")), (True, list("abba"))):
    calls.clear()
    out = timing.interleaved({"a": loop("a"), "b": loop("b")}, repeats=2, warmup=1,
                             alternate=alternate)
    assert calls[2:] == want  # after one warm-up call each
    assert {k: len(v) for k, v in out.items()} == {"a": 2, "b": 2}
