"""The experiment drivers run end to end on tiny configs and write the expected tables.

Every driver runs in this process (jit caches are shared, so the tiny models
compile once per program shape) with the 'tiny' scale: random tiny T5 models
on the offline toy_reverse task. No test asserts on a timing; the checks are
on the tables' rows and columns, the theory columns, and on the artificial-
delay draft leaving logits (and so decoded tokens) unchanged.
"""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import (ablate, batch_scaling, benchmark, demo_quality, draft_free, harness,
                         heads, kernel_threads, paper_tables, peers, reproduce, results_readme,
                         setup_cost, setups, shallow_reuse, step_variants, trees,
                         verify_scaling)
from spec_decode import decoding, experiment, theory
from spec_decode.experiment import measure
from spec_decode.models import delayed as delay
from spec_decode.models.testing import MarkovDecoder


def _run_dirs(runs_dir, prefix):
  """The run directories under `runs_dir` (any scale) whose names start with `prefix`."""
  return sorted(os.path.join(root, d) for root, dirs, _ in os.walk(runs_dir) for d in dirs
                if d.startswith(prefix))


def _rows(md_path):
  """Data rows of the first markdown table in a file, as lists of cells."""
  return _rows_of(open(md_path, encoding="utf-8").read())


def _rows_of(text):
  rows, seen_rule = [], False
  for line in text.splitlines():
    if line.startswith("|---"):
      seen_rule = True
      continue
    if seen_rule and line.startswith("|"):
      rows.append([c.strip() for c in line.strip("|").split("|")])
    elif seen_rule and rows:
      break
  return rows


def _json(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
  d = tmp_path_factory.mktemp("experiments")
  return {"results": str(d / "results"), "runs": str(d / "runs")}


# ------------------------------------------------------------------ the delayed draft
def _markov():
  inner = MarkovDecoder(vocab_size=6, order=1)
  return inner, inner.init(jax.random.PRNGKey(0), scale=2.0)


_ENC = jnp.array([[2, 3, 4], [5, 2, 0]], jnp.int32)


@pytest.mark.parametrize("mode,amount", [("compute", 5), ("sleep", 0.001)])
def test_delayed_decoder_keeps_logits(mode, amount):
  inner, ip = _markov()
  model = delay.DelayedDecoder(inner, mode=mode, matmul_size=8)
  params = model.wrap_params(ip, amount)
  cache = model.init_cache(params, model.encode(params, _ENC), 8)
  toks = jnp.array([[2, 3], [4, 5]], jnp.int32)
  out = model.decode(params, cache, toks)
  logits, new_cache = out.logits, out.cache
  out = inner.decode(ip, inner.init_cache(ip, inner.encode(ip, _ENC), 8), toks)
  ref, ref_cache = out.logits, out.cache
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(new_cache.lengths), np.asarray(ref_cache.lengths))


def test_delayed_draft_decodes_the_same_tokens():
  target, tp = _markov()
  draft = MarkovDecoder(vocab_size=6, order=1)
  dp = draft.init(jax.random.PRNGKey(1), scale=2.0)
  model = delay.DelayedDecoder(draft, mode="compute", matmul_size=8)
  kw = dict(gamma=2, max_decode_len=6, sampling=decoding.Sampling(temperature=1.0),
            rng=jax.random.PRNGKey(3))
  delayed = decoding.speculative(target, tp, model, model.wrap_params(dp, 2), _ENC, **kw)
  plain = decoding.speculative(target, tp, draft, dp, _ENC, **kw)
  np.testing.assert_array_equal(np.asarray(delayed.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(delayed.stats.accepted),
                                np.asarray(plain.stats.accepted))


def test_delayed_decoder_work_survives_compilation():
  inner, ip = _markov()
  model = delay.DelayedDecoder(inner, mode="compute", matmul_size=8)
  params = model.wrap_params(ip, 3)
  cache = model.init_cache(params, model.encode(params, jnp.array([[2, 3]], jnp.int32)), 4)
  text = jax.jit(lambda p, c, t: model.decode(p, c, t).logits).lower(
      params, cache, jnp.array([[2]], jnp.int32)).compile().as_text()
  assert " while(" in text and " dot(" in text  # the matmul chain was not optimized away


def test_delayed_decoder_sleep_runs_once_per_call(monkeypatch):
  calls = []
  real = delay._sleep
  monkeypatch.setattr(delay, "_sleep", lambda s, p: (calls.append(float(s)), real(s, p))[1])
  inner, ip = _markov()
  model = delay.DelayedDecoder(inner, mode="sleep", matmul_size=3)  # fresh jit cache entry
  params = model.wrap_params(ip, 0.0)
  cache = model.init_cache(params, model.encode(params, jnp.array([[2, 3]], jnp.int32)), 4)
  step = jax.jit(model.decode)
  for _ in range(3):
    logits = step(params, cache, jnp.array([[2]], jnp.int32)).logits
    jax.block_until_ready(logits)
  assert calls == [0.0, 0.0, 0.0]


def test_delayed_decoder_rejects_bad_settings():
  inner, ip = _markov()
  with pytest.raises(ValueError, match="mode"):
    delay.DelayedDecoder(inner, mode="spin")
  with pytest.raises(ValueError, match="matmul_size"):
    delay.DelayedDecoder(inner, matmul_size=0)
  with pytest.raises(ValueError, match="Decoder protocol"):
    delay.DelayedDecoder(object())
  model = delay.DelayedDecoder(inner)
  for bad in (-1, 1.5, float("nan")):
    with pytest.raises(ValueError, match="delay"):
      model.wrap_params(ip, bad)


# ------------------------------------------------------------------ setups
def test_setups_parse_at_every_scale():
  for scale in setups.SCALES:
    for draft in ("bigram", "small"):
      s = setups.experiment_setup(scale, "cnndm", draft, temperature=1,
                                  checkpoints={"cnndm_target": "/ckpt/t", "cnndm_small": "/ckpt/s"})
      cfg = setups.parse_config(s.with_bindings(*setups.row_bindings(gamma=2, lenience=0.5)))
      spec = cfg.decoders["speculative"]
      assert spec.gamma == 2 and spec.lenience == 0.5 and cfg.gamma_choice is None
      assert cfg.draft.kind == ("ngram" if draft == "bigram" else "t5")
      if scale == "paper":
        assert cfg.target.checkpoint == "/ckpt/t" and cfg.sampling.temperature == 1.0
        assert not s.missing
      if scale == "demo":
        assert cfg.task == "synthetic_cnndm" and cfg.feature_lengths["inputs"] == 320
  assert setups.experiment_setup("paper", "ende", "small").missing  # no checkpoints given
  assert setups.experiment_setup("paper", "ende", "small_distilled").missing
  with pytest.raises(ValueError, match="unknown scale"):
    setups.experiment_setup("huge", "ende", "small")
  big = setups.experiment_setup("demo", "ende", "small", demo_target="ende_target_big")
  cfg = setups.parse_config(big)
  assert cfg.target.checkpoint.endswith("demo_models/ende_target_big") and not big.missing
  assert cfg.target.name == "demo big target (T5.1.1-small-shaped, 45.6M)"
  # The 3.7M demo target drafts for the big one; it cannot draft for itself.
  mid = setups.parse_config(setups.experiment_setup("demo", "cnndm", "target",
                                                    demo_target="cnndm_target_big"))
  assert mid.draft.checkpoint.endswith("demo_models/cnndm_target")
  assert mid.draft.name == "demo 3.7M target"
  assert setups.experiment_setup("demo", "ende", "target").missing == (
      "ende_target cannot draft for itself",)
  assert setups.experiment_setup("paper", "ende", "target").missing
  with pytest.raises(ValueError, match="demo_target 'ende_target_big' names a demo model"):
    setups.experiment_setup("tiny", "ende", "small", demo_target="ende_target_big")
  with pytest.raises(ValueError, match="NAME=PATH"):
    setups.parse_checkpoints("ende_target")


def test_demo_lengths_match_the_demo_configs():
  text = open(os.path.join(setups.REPO_ROOT, "configs", "demo", "common.gin")).read()
  for task, (_, inputs, targets) in setups.DEMO_TASKS.items():
    prefix = task.upper()
    assert re.search(rf"^{prefix}_INPUT_LENGTH = {inputs}$", text, re.M)
    assert re.search(rf"^{prefix}_TARGET_LENGTH = {targets}$", text, re.M)
    run = open(os.path.join(setups.REPO_ROOT, "configs", "demo", f"{task}_run.gin")).read()
    assert re.search(rf"^INPUT_LENGTH = {inputs}$", run, re.M)
    assert re.search(rf"^TARGET_LENGTH = {targets}$", run, re.M)


# ------------------------------------------------------------------ reproduce
def test_reproduce_table1_is_the_theory(out):
  paths = reproduce.main(["--table", "1", "--results_dir", out["results"]])
  rows = _rows(paths[1]["md"])
  assert len(rows) == len(paper_tables.TABLE1)
  doc = _json(paths[1]["json"])
  for row, (alpha, gamma, ops, speed) in zip(doc["rows"], paper_tables.TABLE1):
    assert (row["alpha"], row["gamma"]) == (alpha, gamma)
    np.testing.assert_allclose(row["speed"], theory.walltime_improvement(alpha, gamma, 0.0))
    np.testing.assert_allclose(row["operations"], theory.operations_factor(alpha, gamma, 0.0))
    np.testing.assert_allclose(row["speed"], speed, atol=0.006)  # the paper rounds to 0.01
    np.testing.assert_allclose(row["operations"], ops, atol=0.006)
    np.testing.assert_allclose(row["sim_speed"], row["speed"], rtol=0.02)  # 200k steps


def _planned(argv, table):
  args = reproduce.parse_args(["--table", str(table)] + argv)
  pargs = reproduce._Args(args.scale, args.demo_targets, args.gamma, args.demo_models, None,
                          None, None, None, (), args.refill_chunk)
  return {row.id: row for row in reproduce.plan(table, pargs)}


def test_reproduce_maps_paper_drafts_by_size_to_the_big_demo_targets():
  rows = _planned([], 2)  # the demo scale's default: the big targets, gamma chosen per run
  assert len(rows) == len(paper_tables.TABLE2)
  for row in rows.values():
    cfg = setups.parse_config(row.jobs["run"].setup)
    assert cfg.target.checkpoint.endswith("_target_big")
    assert cfg.gamma_choice is not None and row.jobs["run"].name.endswith("_gauto")
    assert cfg.refill_chunk == setups.BIG_REFILL_CHUNK  # as the big main jobs decode
  drafts = {rid: setups.parse_config(r.jobs["run"].setup).draft.checkpoint
            for rid, r in rows.items()}
  assert drafts["ende_small_t0"].endswith("demo_models/ende_small")
  assert drafts["cnndm_base_t1"].endswith("demo_models/cnndm_base")
  assert drafts["ende_large_t0"].endswith("demo_models/ende_target")  # T5-large: 1/12 vs 1/14
  t3 = _planned([], 3)
  assert {"ende_large_demo", "ende_small_distilled", "ende_small_distilled_big",
          "cnndm_large_demo", "cnndm_small_distilled_big"} <= set(t3)
  large_demo = setups.parse_config(t3["ende_large_demo"].jobs["t1"].setup)
  assert large_demo.draft.checkpoint.endswith("demo_models/ende_large")
  distilled = setups.parse_config(t3["cnndm_small_distilled_big"].jobs["t0"].setup)
  assert distilled.draft.checkpoint.endswith("demo_models/cnndm_small_distilled_big")
  gamma = paper_tables.paper_gamma("cnndm", "small", 0)  # the paper's small draft's gamma
  assert f"GAMMA = {gamma}" in t3["cnndm_small_distilled_big"].jobs["t0"].setup.bindings
  # The 3.7M targets: the drafts as before, at the paper's gamma.
  small = _planned(["--demo_targets", "small"], 2)["ende_large_t1"].jobs["run"]
  cfg = setups.parse_config(small.setup)
  assert cfg.target.checkpoint.endswith("demo_models/ende_target")
  assert cfg.draft.checkpoint.endswith("demo_models/ende_large") and cfg.gamma_choice is None
  assert cfg.refill_chunk == 0
  assert small.name == "ende_large_t1_g3"
  forced = _planned(["--gamma", "paper"], 4)["cnndm_small_t0"].jobs["run"]
  assert forced.name == "cnndm_small_t0_g5"
  one_call = _planned(["--refill_chunk", "0"], 2)["ende_small_t0"].jobs["run"]
  assert setups.parse_config(one_call.setup).refill_chunk == 0
  assert one_call.key != rows["ende_small_t0"].jobs["run"].key  # a run directory of its own
  assert len(_planned(["--demo_targets", "small"], 3)) == len(paper_tables.TABLE3) + 2


def test_reproduce_orderings_compare_the_paper_and_ours_per_group():
  out = [dict(task="EnDe", temp=0, draft="T5-small", paper_speed=3.4, speed=1.66,
              paper_alpha=0.75, alpha=0.84),
         dict(task="EnDe", temp=0, draft="T5-base", paper_speed=2.8, speed=1.65,
              paper_alpha=0.80, alpha=0.88),
         dict(task="EnDe", temp=0, draft="T5-large", paper_speed=1.7, speed=1.68,
              paper_alpha=0.82, alpha=0.95),
         dict(task="EnDe", temp=1, draft="T5-small", paper_speed=2.6, speed=None,
              paper_alpha=0.62, alpha=0.8)]
  items = {(i["group"], i["quantity"]): i for i in reproduce.orderings(2, out)}
  speed = items[("task EnDe, temp 0", "speed")]
  assert speed["paper"] == ["T5-small", "T5-base", "T5-large"]
  assert speed["ours"] == ["T5-large", "T5-small", "T5-base"] and not speed["agree"]
  alpha = items[("task EnDe, temp 0", "alpha")]
  assert alpha["ours"] == alpha["paper"] == ["T5-large", "T5-base", "T5-small"]
  assert alpha["agree"]
  assert ("task EnDe, temp 1", "speed") not in items  # one row with both values: no order
  md = reproduce._orderings_md(list(items.values()))
  assert "| task EnDe, temp 0 | speed | T5-small > T5-base > T5-large | T5-large > T5-small " \
      "> T5-base | no |" in md
  assert reproduce.orderings(1, out) == [] and reproduce._orderings_md([]) == ""


@pytest.mark.slow
def test_reproduce_tables_2_to_5_tiny(out):
  paths = reproduce.main(["--table", "2,3,4,5", "--scale", "tiny", "--num_examples", "1",
                          "--rows", "ende_small_t1,ende_small,small",
                          "--step_timing_repeats", "2",
                          "--results_dir", out["results"], "--runs_dir", out["runs"],
                          "--fail_fast"])
  t2, t3, t4, t5 = (_json(paths[t]["json"])["rows"] for t in (2, 3, 4, 5))
  assert len(_rows(paths[2]["md"])) == len(t2) == len(paper_tables.TABLE2)
  assert len(_rows(paths[3]["md"])) == len(t3) == len(paper_tables.TABLE3) + 2  # + distilled
  distilled = [r for r in t3 if r["draft"].startswith("T5-small distilled")]
  assert [r["target"] for r in distilled] == ["T5-XXL EnDe", "T5-XXL CNNDM"]
  assert all(r["paper_t0"] is None and r["paper_t1"] is None for r in distilled)
  assert len(_rows(paths[4]["md"])) == len(t4) == len(paper_tables.TABLE4)
  assert len(_rows(paths[5]["md"])) == len(t5) == len(paper_tables.TABLE5)
  ran = [r for r in t2 if (r["task"], r["draft"], r["temp"]) == ("EnDe", "T5-small", 1)]
  assert len(ran) == 1 and 0.0 <= ran[0]["alpha"] <= 1.0 and ran[0]["speed"] > 0
  assert all("not run" in r["note"] for r in t2 if r is not ran[0])
  run4 = next(r for r in t4 if (r["task"], r["draft"], r["temp"]) == ("EnDe", "T5-small", 1))
  assert run4["c"] == run4["c_run"] > 0  # the run's own c (in-loop, interleaved)
  assert run4["gamma"] == run4["gamma_ours"] == 7  # the tiny scale runs the paper's gamma
  np.testing.assert_allclose(run4["predicted"],
                             theory.walltime_improvement(run4["alpha"], 7, run4["c"]),
                             rtol=1e-6)
  np.testing.assert_allclose(run4["cost_model"], theory.expected_tokens(run4["alpha"], 7)
                             / (7 * run4["c"] + run4["verify_ratio"]), rtol=1e-6)
  assert run4["setup_measured"] and run4["setup_model"] > 0  # the run timed its set-up
  # The fraction is the run's timed set-up over its autoregressive seconds per example. Both
  # are wall-clock; on a tiny model under load the separately timed set-up call can exceed
  # the whole fused decode, so the test checks the arithmetic, not a bound on the timing.
  (summary_path,) = [os.path.join(d, "results.json") for d in _run_dirs(out["runs"],
                                                                        "ende_small_t1_g7-")]
  summary = _json(summary_path)
  timing = summary["timing"]
  np.testing.assert_allclose(
      run4["setup_fraction"],
      timing["setup_seconds"]["target"] / (timing["autoregressive_seconds"]
                                           / summary["completed"]), rtol=1e-6)
  # A set-up timed longer than the whole autoregressive decode is flagged in the row's note.
  assert ("set-up timed alone" in run4["note"]) == (run4["setup_fraction"] > 1.0)
  np.testing.assert_allclose(run4["setup_efficiency"], run4["speed"] / run4["setup_model"],
                             rtol=1e-6)
  small3 = next(r for r in t3 if r["draft"] == "T5-small" and r["target"] == "T5-XXL EnDe")
  assert 0.0 <= small3["t0"] <= 1.0 and 0.0 <= small3["t1"] <= 1.0
  assert all(r["note"].startswith("not reproduced") for r in t3 if r["target"].startswith(
      ("GPT", "LaMDA")))
  small5 = next(r for r in t5 if r["draft"] == "T5-small")
  alphas = [small5[f"l{l:g}"] for l in paper_tables.LENIENCES]
  assert all(0.0 <= a <= 1.0 for a in alphas)
  assert small5["l1"] == small3["t1"]  # the same run (shared between the tables)
  header = open(paths[4]["md"]).read()
  assert "Command: `python -m experiments.reproduce" in header and "Machine:" in header
  assert "python -m spec_decode.main" in header  # each run's own command


# ------------------------------------------------------------------ the other drivers
_TINY_MODELS = ["--target", "t5_1_1_tiny", "--draft", "t5_1_1_tiny", "--vocab_size", "259",
                "--draft_config", json.dumps({
                    "emb_dim": 16, "num_heads": 2, "head_dim": 8, "mlp_dim": 32,
                    "num_encoder_layers": 1, "num_decoder_layers": 1})]


# The drivers below decode with the tiny scale's shapes and settings where they can (gamma 7,
# temperature 1, 24 input / 10 output tokens, batch 1), so they reuse the programs the
# reproduce test compiled: only the shapes they add (step calls, batch 2) compile anew.
@pytest.mark.slow
def test_benchmark_tiny(out):
  paths = benchmark.main(_TINY_MODELS + [
      "--gammas", "1,2,7", "--gamma", "7", "--temperature", "1", "--repeats", "2", "--inner",
      "1", "--input_length", "24", "--decode_len", "10", "--num_examples", "2",
      "--e2e_repeats", "1", "--roofline", "on", "--copy_mib", "4", "--name", "tiny",
      "--setup_kernel_weights", "bfloat16_dot_if_supported", "--results_dir", out["results"]])
  rows = _rows(paths["md"])
  assert [r[0] for r in rows] == ["1", "2", "7"]
  doc = _json(paths["json"])
  s = doc["summary"]
  assert s["target"]["setup_kernel_weights"] == "bfloat16_dot_if_supported"
  assert "setup_kernel_weights" not in s["draft"]
  assert s["c"] > 0 and s["target_step"]["n"] == 2 and s["marginal_step_costs"]
  assert s["c_rounds"]["n"] == 2
  for k in ("autoregressive", "speculative"):
    assert s["e2e"][k]["tokens_per_second"] > 0 and s["e2e"][k]["iterations"] > 0
  assert 0.0 <= s["e2e"]["alpha"] <= 1.0
  assert s["roofline"]["bytes_per_step"] > 0 and s["roofline"]["roofline_fraction"] > 0
  g7 = doc["rows"][2]
  np.testing.assert_allclose(g7["thm38"], theory.walltime_improvement(
      s["e2e"]["alpha"], 7, s["c"]), rtol=1e-6)
  text = open(paths["md"]).read()
  assert "T_p (target step)" in text and "memory roofline" in text and "engine split" in text


def test_call_fit_separates_fixed_and_per_iteration_costs():
  iterations = np.array([3, 5, 5, 8, 12])
  seconds = 0.004 + 0.0006 * iterations + np.array([1, -1, 1, -1, 0]) * 1e-5
  fit = measure.fixed_and_per_iteration(seconds, iterations)
  np.testing.assert_allclose([fit["fixed"], fit["per_iteration"]], [0.004, 0.0006], rtol=0.02)
  assert fit["calls"] == 5 and 0 < fit["residual_rms"] < 2e-5
  assert measure.fixed_and_per_iteration([0.1, 0.2], [4, 4]) is None  # one iteration count
  with pytest.raises(ValueError, match="equal-length"):
    measure.fixed_and_per_iteration([0.1, 0.2], [4])


def test_model_work_speedup_charges_setup_per_call():
  # Two calls: autoregressive 2 ms set-up + 10 steps of 1 ms each; speculative 2 + 0.5 ms
  # set-up + 3 iterations of 2 ms each.
  got = measure.model_work_speedup(target_setup=[0.002, 0.002], draft_setup=[0.0005, 0.0005],
                                 target_step=0.001, ar_iterations=[10, 10],
                                 spec_iteration=0.002, spec_iterations=[3, 3])
  np.testing.assert_allclose(got, (0.004 + 0.020) / (0.005 + 0.012))
  # No set-up: the loops' ratio alone.
  np.testing.assert_allclose(measure.model_work_speedup(
      target_setup=[0.0], draft_setup=[0.0], target_step=0.001, ar_iterations=[12],
      spec_iteration=0.002, spec_iterations=[3]), 2.0)
  with pytest.raises(ValueError, match="one length"):
    measure.model_work_speedup(target_setup=[0.1], draft_setup=[0.1, 0.1], target_step=1.0,
                             ar_iterations=[1], spec_iteration=1.0, spec_iterations=[1])
  with pytest.raises(ValueError, match="positive"):
    measure.model_work_speedup(target_setup=[0.1], draft_setup=[0.1], target_step=0.0,
                             ar_iterations=[1], spec_iteration=1.0, spec_iterations=[1])


@pytest.mark.slow
def test_peers_tiny(out):
  pytest.importorskip("transformers")
  paths = peers.main(_TINY_MODELS + [
      "--gamma", "7", "--input_length", "24", "--decode_len", "10", "--num_examples", "2",
      "--repeats", "1", "--name", "tiny", "--results_dir", out["results"]])
  doc = _json(paths["json"])
  names = [r["decoder"] for r in doc["rows"]]
  assert names[:4] == ["ours: autoregressive", "ours: speculative (gamma 7)",
                       "ours: source lookup (7 tokens)", "HF: greedy generate"]
  assert any("assisted" in n for n in names) and any("prompt lookup" in n for n in names)
  for r in doc["rows"]:
    assert r["tokens_per_second"] > 0
    # the same weights: every exact decoder reproduces our autoregressive tokens
    assert r["identical"] == 1.0, r
  assert doc["rows"][0]["speedup_over_own_baseline"] == 1.0
  assert doc["summary"]["ours_speculative_over_hf_assisted"] > 0
  assert doc["summary"]["ours_lookup_speedup"] > 0
  assert doc["summary"]["hf_prompt_lookup_speedup"] > 0
  with pytest.raises(SystemExit):
    peers.parse_args(["--target", "t5_1_1_tiny"])


def test_setup_charged_speedup_from_a_runs_own_seconds():
  # 10 s of autoregressive decoding per example, 8 tokens; 3 speculative calls of gamma c +
  # T_verify / T_p = 2 steps each.
  kw = dict(ar_seconds=10.0, tokens=8, target_calls=3, iteration_steps=2.0)
  # Set-up timed (2 s, the draft's 0.5 s): the step is the decode's own, (10 - 2) / 8 = 1 s,
  # whatever the timing loop said.
  for t_p in (0.5, 1.0, 1.25):
    np.testing.assert_allclose(harness.setup_charged_speedup(
        target_step=t_p, setup=2.0, draft_setup=0.5, **kw), 10.0 / (2.0 + 0.5 + 3 * 2.0))
  # Not timed: the set-up is 10 - 8 T_p, none at all for a T_p timed slow (1.25 s).
  np.testing.assert_allclose(harness.setup_charged_speedup(target_step=1.0, **kw),
                             10.0 / (2.0 + 3 * 2.0))
  np.testing.assert_allclose(harness.setup_charged_speedup(target_step=1.25, **kw),
                             10.0 / (3 * 2.0 * 1.25))
  assert harness.setup_charged_speedup(target_step=1.0, **dict(kw, target_calls=0)) is None


@pytest.mark.slow
def test_heads_on_the_demo_pair(out):
  paths = heads.main(["--tasks", "ende", "--temperatures", "0", "--num_examples", "1",
                      "--repeats", "1", "--timing_repeats", "2", "--demo_targets", "small",
                      "--results_dir", out["results"], "--stem", "heads_ende_small"])
  assert paths["json"].endswith("heads_ende_small.json")
  rows = _json(paths["json"])["rows"]
  assert [r["decoder"] for r in rows] == ["autoregressive", "small draft (gamma 4)",
                                          "EAGLE head (gamma 4)", "Medusa heads (gamma 4)",
                                          "MTP modules (gamma 4)"]
  for r in rows:
    assert r["identical"] == 1.0 and r["tokens_per_target_call"] >= 1.0
  for r in rows[1:]:
    assert 0.0 <= r["alpha"] <= 1.0 and r["c"] > 0
    assert 1.0 <= r["first_call"] <= 5  # at most gamma + 1 tokens
  # the shipped 3.7M-target EAGLE head has no learned start, nor do the MTP modules
  assert rows[2]["first_call"] == rows[4]["first_call"] == 1.0
  with pytest.raises(SystemExit):
    heads.parse_args(["--tasks", "wmt"])


def test_ablate_decodes_as_the_main_jobs_with_the_big_targets():
  assert ablate.parse_args([]).refill_chunk == setups.BIG_REFILL_CHUNK
  assert ablate.parse_args(["--demo_targets", "small"]).refill_chunk == 0
  assert ablate.parse_args(["--scale", "tiny"]).refill_chunk == 0
  assert ablate.parse_args(["--refill_chunk", "0"]).refill_chunk == 0
  with pytest.raises(SystemExit):
    ablate.parse_args(["--refill_chunk", "-1"])


@pytest.mark.slow
def test_ablate_tiny(out, monkeypatch):
  # Executables released after every variant and gamma (a full sweep would run out of
  # memory maps otherwise): the next ones compile again and measure the same decisions.
  released = []
  real = ablate.release_executables_if_crowded
  monkeypatch.setattr(ablate, "release_executables_if_crowded",
                      lambda: released.append(real(fraction=0.0)))
  made = []  # every decoder, the baseline too, decodes in the refill loop's one slot
  real_fn = harness.decode_fn
  monkeypatch.setattr(harness, "decode_fn", lambda algorithm, *a, **kw: made.append(
      (type(algorithm).__name__, kw.get("refill_batch"))) or real_fn(algorithm, *a, **kw))
  paths = ablate.main(["--scale", "tiny", "--drafts", "small", "--gammas", "7",
                       "--temperature", "1", "--added_c", "0.5,1", "--matmul_size", "16",
                       "--repeats", "1", "--inner", "1", "--num_examples", "3",
                       "--refill_chunk", "2", "--results_dir", out["results"]])
  doc = _json(paths["json"])
  rows = doc["rows"]
  assert [(r["added_c"], r["gamma"]) for r in rows] == [(None, 7), (0.5, 7), (1.0, 7)]
  assert len(_rows_of(doc["readme_markdown"])) == 3  # one summary row per draft variant
  assert len(_rows(paths["md"])) == 3
  # The delay adds an exact 0 to the draft's logits and the keys are the same: the same
  # decisions in every row. alpha (the mean of sum_x min(p, q)) is computed by each
  # variant's own compiled program, whose fusions may round q differently in the last bit
  # (an AVX-512 AMD EPYC of family 25, model 17: 0.48679790 against 0.48679791).
  for key in ("alpha_observed", "tokens_per_call", "target_calls", "tokens"):
    assert len({r[key] for r in rows}) == 1, key
  np.testing.assert_allclose([r["alpha"] for r in rows], rows[0]["alpha"], rtol=1e-6)
  assert released == [True] * 3 or experiment.memory_map_use() is None
  for r in rows:
    np.testing.assert_allclose(r["thm38"], theory.walltime_improvement(
        r["alpha"], r["gamma"], r["c"]), rtol=1e-6)
    assert r["optimal_gamma_cost_model"] == 7 and r["setup_model"] > 0  # one gamma swept
    assert r["target_calls"] >= 1 and r["tokens"] >= 1
    assert r["verify_ratio_fitted"] == r["verify_ratio"]  # one size: nothing to fit
    np.testing.assert_allclose(r["setup_model_deviation"], r["speedup"] / r["setup_model"] - 1)
    assert r["worst_setup_model_deviation"] == r["setup_model_deviation"]  # one gamma each
  assert "Each decode call takes 2 batches' worth" in open(paths["md"]).read()
  assert made == [("Autoregressive", 1)] + [("Speculative", 1)] * 3
  pngs = [p for k, p in paths.items() if k.startswith("png_")]
  assert len(pngs) == 3
  for p in pngs:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_batch_scaling_tiny(out):
  paths = batch_scaling.main(["--scale", "tiny", "--batch_sizes", "1,2", "--num_examples", "2",
                              "--gamma", "7", "--temperature", "1", "--repeats", "2",
                              "--inner", "1", "--refill_chunk", "2", "--kernel_weights",
                              "float32", "--results_dir", out["results"],
                              "--runs_dir", out["runs"]])
  assert paths["md"].endswith("batch_scaling_ende_refill2_float32.md")
  rows = _json(paths["json"])["rows"]
  assert [r["batch_size"] for r in rows] == [1, 2]
  assert all(r["examples"] == 2 and r["c"] > 0 for r in rows)
  for r in rows:
    run = _json(os.path.join(out["runs"], "tiny", f"ende_small_t1_g7_b{r['batch_size']}"
                             "_refill2_float32", "results.json"))
    assert r["speedup"] == run["speedup_measured"]  # the run's own, not recomputed
    assert run["experiment"]["refill_chunk"] == 2
    assert (run["experiment"]["target"]["kernel_weights"]
            == run["experiment"]["draft"]["kernel_weights"] == "float32")
    np.testing.assert_allclose(r["thm38"], theory.walltime_improvement(r["alpha"], 7, r["c"]),
                               rtol=1e-6)
  assert [r[0] for r in _rows(paths["md"])] == ["1", "2"]
  text = open(paths["md"]).read()
  assert "Refill: each call decodes 2 batches' worth" in text and "'float32'" in text


@pytest.mark.slow
def test_batch_scaling_with_chosen_gamma_and_compaction(out):
  paths = batch_scaling.main([
      "--scale", "tiny", "--batch_sizes", "2", "--num_examples", "2", "--gamma", "auto",
      "--compact_batch", "--temperature", "1", "--repeats", "2", "--inner", "1",
      "--gin_bindings", "GammaChoice.max_gamma = 3", "--gin_bindings",
      "GammaChoice.warmup_examples = 2", "--gin_bindings", "GammaChoice.fallback_below = None",
      "--no_plots", "--results_dir", out["results"], "--runs_dir", out["runs"]])
  assert paths["md"].endswith("batch_scaling_ende_compact.md")
  (row,) = _json(paths["json"])["rows"]
  run_dir = os.path.join(out["runs"], "tiny", "ende_small_t1_gauto_b2_compact")
  choice = _json(os.path.join(run_dir, "gamma.json"))
  assert row["gamma"] == choice["gamma"] == choice["cost_model"]["gamma"]
  experiment_json = _json(os.path.join(run_dir, "results.json"))["experiment"]
  assert experiment_json["baseline"]["compact_batch"] is True
  assert experiment_json["decoders"]["speculative"]["compact_batch"] is True
  assert "shrink their batch" in open(paths["md"]).read()


@pytest.mark.slow
def test_batch_scaling_reports_a_fallback(out):
  """A batch size where the gamma choice falls back (forced by the threshold) is a row at
  gamma 0 whose costs and predictions are those of the gamma it would have used."""
  paths = batch_scaling.main([
      "--scale", "tiny", "--batch_sizes", "1", "--num_examples", "1", "--gamma", "auto",
      "--repeats", "2", "--inner", "1", "--gin_bindings", "GammaChoice.max_gamma = 2",
      "--gin_bindings", "GammaChoice.warmup_examples = 1",
      "--gin_bindings", "GammaChoice.fallback_below = 1000.0", "--no_plots",
      "--results_dir", out["results"], "--runs_dir", out["runs"]])
  (row,) = _json(paths["json"])["rows"]
  choice = _json(os.path.join(out["runs"], "tiny", "ende_small_t0_gauto_b1", "gamma.json"))
  assert row["gamma"] == choice["gamma"] == 0
  assert row["best_gamma"] == choice["cost_model"]["gamma"] >= 1
  assert row["alpha"] == choice["alpha"] and "speculation cannot pay" in row["fallback"]
  assert row["identical"] == 1.0 and row["cost_model"] > 0


@pytest.mark.slow
def test_trees_tiny(out):
  paths = trees.main(["--scale", "tiny", "--tasks", "ende", "--temperatures", "1",
                      "--budgets", "2,4", "--num_examples", "2", "--max_tokens", "8",
                      "--step_timing_repeats", "2", "--results_dir", out["results"],
                      "--runs_dir", out["runs"]])
  res = _json(paths["json"])
  assert [r["decoder"] for r in res["rows"]] == ["chain_g4", "tree_b2", "tree_b4"]
  run = _json(os.path.join(out["runs"], "tiny", "ende_t1", "results.json"))
  for r in res["rows"]:
    d = run["decoders"][r["decoder"]]
    assert r["speedup"] == d["speedup_measured"] and r["tokens_per_call"] >= 1
  assert run["experiment"]["decoders"]["tree_b4"]["drafter"]["budget"] == 4
  for curve in ("verify_curve", "draft_curve"):
    assert set(res[curve]["ende"]) == {"1", "2", "4", "8"}
  # the budget choice reads the largest tree's confidences: E(B) = 1 + their prefix sums
  choice = res["budget_choice"]["ende_t1"]
  assert choice["from_budget"] == 4 and choice["budget"] in (2, 3, 4)
  mass = res["rows"][2]["draft_mass_at"]
  assert len(mass) == 4 and all(a >= b for a, b in zip(mass, mass[1:]))
  for r in res["rows"][1:]:
    assert r["expected_tokens_conf"] == pytest.approx(1 + sum(mass[:r["budget"]]))
    assert r["t_verify_ratio"] > 0 and r["predicted_speedup"] > 0
  assert sum(r["chosen"] for r in res["rows"][1:]) == (choice["budget"] != 3)


def test_lookup_ceiling():
  src = np.array([[5, 6, 7, 5, 6, 8, 1]])
  # the first match of "5" continues 6 7 ..: 1 token accepted; the second (6 8 1) all three
  assert draft_free.lookup_ceiling(src, [[5, 6, 8, 1]], gamma=4, width=1) == pytest.approx(4 / 3)
  assert draft_free.lookup_ceiling(src, [[5, 6, 8, 1]], gamma=4, width=8) == 2.0
  assert draft_free.lookup_ceiling(src, [[9, 9, 9, 1]], gamma=4) == pytest.approx(4 / 3)


@pytest.mark.slow
def test_draft_free_tiny(out):
  # temperature 0 only (the driver passes the temperature through; the drafters' sampling
  # is checked exactly in test_draft_free): half the driver's runs, each a compile
  paths = draft_free.main(["--scale", "tiny", "--temperatures", "0", "--num_examples", "2",
                           "--repeats", "1", "--cost_repeats", "2", "--bigram_examples", "20",
                           "--results_dir", out["results"]])
  res = _json(paths["json"])
  rows = res["rows"]
  names = ["lookup", "lookup, <= 2 after a 1-gram", "lookup tree, 2 matches", "layer skip 1",
           "layer skip 2", "layer skip 1 + exit adapter", "lookup, else layer skip 1",
           "bigram table", "small draft"]
  assert [r["decoder"] for r in rows] == names
  assert [r["temperature"] for r in rows] == [0.0] * 9
  for r in rows:
    assert r["tokens_per_call"] >= 1 and r["c"] > 0 and r["speedup"] > 0
    assert r["c_in_loop"] >= 0  # the proposal after a verify call, minus the call
    # a tree's tokens per call are measured, not predicted from alpha
    tree = r["decoder"].startswith("lookup tree")
    assert r["speedup_fastest"] > 0 and (r["predicted"] is None if tree else r["predicted"] > 0)
    assert r["draft_model"] == {"bigram table": "bigram", "small draft": "small",
                                "layer skip 1 + exit adapter": "adapter"}.get(r["decoder"],
                                                                              "none")
    assert r["identical_fraction"] == 1.0  # greedy: every decoder equals the baseline
  # the lookup proposes no more than its cap after a single-token match; the chains always gamma
  assert rows[1]["drafted_per_call"] <= rows[0]["drafted_per_call"]
  assert all(r["drafted_per_call"] == 4 for r in rows if r["decoder"].startswith("layer"))
  assert set(res["lookup_ceiling"]["toy_reverse"]) == {"1", "8"}
  for t in ("0",):
    best = res["best_layer_skip_depth"][f"toy_reverse_t{t}"]
    skips = [r for r in rows if r["decoder"].startswith("layer skip")
             and r["draft_model"] == "none" and r["temperature"] == float(t)]
    assert best["predicted"] == max(r["predicted"] for r in skips) and best["k"] in (1, 2)
  with pytest.raises(SystemExit):
    draft_free.main(["--tasks", "fr"])
  with pytest.raises(SystemExit):
    draft_free.main(["--layers", "0"])


@pytest.mark.slow
def test_shallow_reuse_tiny(out):
  paths = shallow_reuse.main(["--scale", "tiny", "--num_examples", "3", "--batch_sizes", "2",
                              "--repeats", "1", "--results_dir", out["results"]])
  rows = _json(paths["json"])["rows"]
  assert [(r["decoder"], r["reuse"]) for r in rows] == [
      ("layer skip 1", True), ("layer skip 1, no reuse", False),
      ("layer skip 1 + exit adapter", True), ("layer skip 1 + exit adapter, no reuse", False)]
  for r in rows:
    assert r["batch"] == 2 and r["examples"] == 2  # whole batches of the 3 examples
    assert r["identical_fraction"] == 1.0  # greedy: both forms equal the baseline
    assert r["speedup"] > 0 and (r["reuse_gain"] > 0 if r["reuse"] else
                                 r["reuse_gain"] is None)
  # the two forms verify the same proposals: the same tokens per call
  assert rows[0]["tokens_per_call"] == rows[1]["tokens_per_call"]
  assert rows[2]["tokens_per_call"] == rows[3]["tokens_per_call"]
  with pytest.raises(SystemExit):
    shallow_reuse.main(["--batch_sizes", "0"])


@pytest.mark.slow
def test_verify_scaling_tiny(out):
  paths = verify_scaling.main(["--models", "t5_1_1_tiny", "--tokens", "3", "--repeats", "1",
                               "--compare_xla_dots", "--results_dir", out["results"]])
  res = _json(paths["json"])
  row, xla_row = res["rows"]
  assert row["compiler"] == "project" and row["params"] > 0 and row["t_p_ms"] > 0
  assert xla_row["compiler"] == "project, XLA dots" and xla_row["t_p_ms"] > 0
  assert set(row["ratios"]) == {"1", "3"} and row["ratios"]["1"] == 1.0
  with pytest.raises(SystemExit):
    verify_scaling.main(["--models", "", "--results_dir", out["results"]])


@pytest.mark.slow
def test_setup_cost_ende(out):
  """Each setting timed on the big demo EnDe target; the padding rows' switch is on again
  after; skipping padding rows changes no state, bfloat16 dot products do (where the CPU
  has them)."""
  from spec_decode.kernels import cpu_matmul
  from spec_decode.models import t5
  paths = setup_cost.main(["--tasks", "ende", "--num_examples", "3", "--rounds", "1",
                           "--results_dir", out["results"]])
  rows = {r["setting"]: r for r in _json(paths["json"])["rows"]}
  dot = cpu_matmul.has_bfloat16_dot()
  assert set(rows) == {"real_rows", "every_row"} | ({"bfloat16_dot"} if dot else set())
  for row in rows.values():
    assert row["task"] == "synthetic_ende" and row["examples"] == 3
    assert 1 <= row["real_length"] <= row["bucket"] <= 32
    assert row["ms"] > 0
    assert row["speedup"] == pytest.approx(rows["real_rows"]["ms"] / row["ms"])
  assert rows["real_rows"]["state_difference"] == rows["every_row"]["state_difference"] == 0
  if dot:
    assert 0 < rows["bfloat16_dot"]["state_difference"] < 0.1
  else:
    assert "no AVX512-BF16" in open(paths["md"]).read()
  assert t5.SKIP_PADDING_ROWS
  for bad in (["--tasks", "wmt"], ["--settings", "real_rows,fp8"],
              ["--settings", "real_rows,real_rows"]):
    with pytest.raises(SystemExit):
      setup_cost.main(bad + ["--results_dir", out["results"]])


@pytest.mark.slow
def test_kernel_threads(out):
  """The kernel's split counters over a decode step and the set-up of the big EnDe target."""
  from spec_decode.kernels import cpu_matmul
  if not cpu_matmul.available():
    pytest.skip(cpu_matmul.unavailable_reason())
  paths = kernel_threads.main(["--tokens", "1", "--num_examples", "2", "--repeats", "1",
                               "--results_dir", out["results"]])
  step, set_up = _json(paths["json"])["rows"]
  assert step["what"] == "decode step" and set_up["what"].startswith("set-up")
  for row in (step, set_up):
    assert row["ms"] > 0 and 0 <= row["helper_share"] <= 1 and 0 <= row["helper_idle"] <= 1
    assert 0 <= row["helper_same_cpu"] <= 1
  with pytest.raises(SystemExit):
    kernel_threads.main(["--repeats", "0", "--results_dir", out["results"]])


@pytest.mark.slow
def test_draft_layout_packs_the_small_draft_into_fewer_thunks(out):
  """The small demo draft in the kernel's layout and in XLA's dots, after the 3.7M target's
  verify call: the kernel's layout packs every matrix and runs fewer thunks per step."""
  from experiments import draft_layout
  from spec_decode.kernels import cpu_matmul
  if not cpu_matmul.available():
    pytest.skip(cpu_matmul.unavailable_reason())
  paths = draft_layout.main(["--target", "demo:ende_target", "--drafts", "demo:ende_small",
                             "--repeats", "1", "--steps", "1", "--setup_examples", "1",
                             "--gammas", "3,1", "--results_dir", out["results"]])
  got = _json(paths["json"])["rows"]
  assert sorted((r["layout"], r["gamma"]) for r in got) == [
      ("kernel", 1), ("kernel", 3), ("xla_dots", 1), ("xla_dots", 3)]
  rows = {r["layout"]: r for r in got if r["gamma"] == 3}
  assert rows["xla_dots"]["packed"] == 0 < rows["kernel"]["packed"]
  assert rows["kernel"]["thunks"] < rows["xla_dots"]["thunks"]
  for r in got:
    assert r["alone_ms"] > 0 and r["setup_ms"] > 0 and r["verify_loop_ms"] > 0
  for bad in (["--layouts", "fast"], ["--drafts", ""], ["--position", "60"],
              ["--gammas", "0"], ["--gammas", "two"], ["--gammas", "5,40"]):
    with pytest.raises(SystemExit):
      draft_layout.main(bad + ["--results_dir", out["results"]])


@pytest.mark.slow
def test_loop_split_times_the_decoders_own_bodies(out):
  """The loop bodies the decoders run, on the 3.7M pair at batch 2: a row per gamma with the
  three speculative timings, the differences as spreads, and the autoregressive pair; bad
  arguments stop with a usage error."""
  from experiments import loop_split
  paths = loop_split.main(["--target", "demo:ende_target", "--draft", "demo:ende_small",
                           "--task", "synthetic_ende", "--input_length", "32", "--gammas",
                           "2,1", "--iterations", "1", "--steps", "1", "--repeats", "1",
                           "--batch", "2", "--results_dir", out["results"]])
  rows = _json(paths["json"])["rows"]
  assert [r["gamma"] for r in rows] == [1, 2]
  assert [r["batch"] for r in rows] == [2, 2]
  for r in rows:
    for key in ("speculative_ms", "fixed_ms", "verify_ms", "verify_fixed_ms", "proposal_ms",
                "step_ms", "autoregressive_ms"):
      assert r[key] > 0, key
    # --position auto: the calls alone read as far as the bodies' marginal iterations
    # (1 -> 2 iterations from the start: a few tokens), in a cache as long as theirs
    assert 1 <= r["fixed_position"] <= r["verify_position"] <= 2 * (r["gamma"] + 1)
    assert 4 <= r["step_position"] <= 8
    assert r["cache_length"] > r["verify_position"] + r["gamma"]
    assert set(r["finished"]) == {"autoregressive", f"speculative:{r['gamma']}",
                                  f"fixed:{r['gamma']}"}
    assert all(0.0 <= v <= 1.0 for v in r["finished"].values())
    for key in ("draft_in_loop", "bookkeeping", "ar_loop_work"):
      assert r[key]["p25"] <= r[key]["median"] <= r[key]["p75"], key
    assert r["draft_in_loop"]["median"] == pytest.approx(r["speculative_ms"] - r["fixed_ms"])
  assert rows[0]["ar_loop_work"] == rows[1]["ar_loop_work"]
  for bad in (["--gammas", "0"], ["--gammas", "x"], ["--example", "-1"],
              ["--position", "60"], ["--position", "x"], ["--batch", "0"]):
    with pytest.raises(SystemExit):
      loop_split.main(bad + ["--results_dir", out["results"]])


def test_results_readme(tmp_path):
  """A README section per driver output in a results directory (two committed files copied),
  the not-measured list, and a clear error for a directory that does not exist."""
  import shutil
  results = tmp_path / "results"
  results.mkdir()
  for stem in ("table_1", "kernel_threads"):
    for ext in ("json", "md"):
      shutil.copy(os.path.join(harness.RESULTS_DIR, f"{stem}.{ext}"), results)
  path = results_readme.main(["--results_dir", str(results)])
  text = open(path).read()
  for stem in ("table_1", "kernel_threads"):
    assert f"{stem}.md" in text
  assert text.count("Command: `python -m experiments.") >= 2
  assert "Not measured here" in text
  for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
    assert os.path.exists(os.path.join(setups.REPO_ROOT, link)), link
  with pytest.raises(FileNotFoundError, match="the results directory .*missing"):
    results_readme.main(["--results_dir", str(tmp_path / "missing")])


def test_results_readme_names_what_tells_files_of_one_title_apart():
  """Files with one title (a table measured on two CPU families; two runs on one CPU) get
  headings with their CPU, or their file name where the CPU is the same; a lone title stays."""
  doc = lambda title, cpu: {"markdown": f"# {title}\n\nbody",
                            "meta": {"machine": {"decoding": {"cpu": {"model": cpu}}}}}
  docs = {"table_2": doc("Table 2", "AMD EPYC (family 26, model 2)"),
          "table_2_amd_epyc_avx2": doc("Table 2", "AMD EPYC (family 25, model 1)"),
          "heads_a": doc("Heads", "X"), "heads_b": doc("Heads", "X"), "trees": doc("Trees", "X")}
  assert results_readme._headings(docs) == {
      "table_2": "Table 2 (AMD EPYC (family 26, model 2))",
      "table_2_amd_epyc_avx2": "Table 2 (AMD EPYC (family 25, model 1))",
      "heads_a": "Heads (heads_a)", "heads_b": "Heads (heads_b)", "trees": "Trees"}
  assert results_readme._section("trees", docs["trees"], "r", "Trees").startswith("### Trees\n")


# ------------------------------------------------------------------ demo quality
@pytest.mark.slow
def test_demo_quality_scores_the_shipped_models(out, tmp_path):
  """Two EnDe examples, two shipped models (a copied demo dir), the reference rows."""
  import shutil
  demo = tmp_path / "demo"
  demo.mkdir()
  for name in ("ende_target", "ende_small"):
    shutil.copytree(os.path.join(setups.DEMO_DIR, name), demo / name)
  paths = demo_quality.main(["--tasks", "ende", "--num_examples", "3", "--batch_size", "2",
                             "--demo_models", str(demo), "--results_dir", out["results"]])
  rows = {r[1]: r for r in _rows(paths["md"])}
  assert set(rows) == {"reference sample", "reference mode", "ende_target_big", "ende_target",
                       "ende_large", "ende_base", "ende_small", "ende_small_distilled"}
  assert rows["ende_large"][-1] == "not shipped" and rows["ende_target_big"][-1] == "not shipped"
  assert rows["ende_target"][2] == "3.69M" and rows["ende_small"][2] == "0.44M"
  for name in ("reference sample", "reference mode", "ende_target", "ende_small"):
    assert 0.0 <= float(rows[name][4]) <= 100.0 and rows[name][3] == "3"
  doc = _json(paths["json"])
  assert doc["meta"]["command"].startswith("python -m experiments.demo_quality --tasks ende")
  with pytest.raises(SystemExit):
    demo_quality.main(["--tasks", "fr"])


# ------------------------------------------------------------------ GPU report
def test_gpu_report_computes_from_the_result_files(tmp_path):
  """gpu_report on a copy of the shipped H200 results: every figure is the files' own (the
  roofline fraction, t(N)), the drafts' steps come from verify_scaling's printed lines, and
  the Table 2 rows are Thm 3.8 / the cost model at the measured c and t(gamma + 1)."""
  import shutil
  from experiments import gpu_report
  src = os.path.join(setups.REPO_ROOT, "experiments", "results", "gpu_h200")
  d = tmp_path / "gpu"
  shutil.copytree(src, d, ignore=shutil.ignore_patterns("README.md"))
  (d / "drafts.log").write_text(
      "noise\nt5_1_1_base (random) (247.6M, project): T_p 0.500 ms, t(1) 1.00, t(5) 0.75\n")
  text = open(gpu_report.main(["--dir", str(d)])).read()
  b1 = json.load(open(d / "benchmark_gpu_xxl_small_b1.json"))["summary"]
  assert f"**{b1['roofline']['roofline_fraction']:.3f}**" in text
  t_p, t_q = b1["target_step"]["median"], b1["draft_step"]["median"]
  ratio = {r["gamma"]: r["verify_ratio"] for r in json.load(
      open(d / "benchmark_gpu_xxl_small_b1.json"))["rows"]}
  rows = {(r[0], r[1], r[2], r[3]): r for r in _rows_of(text.split("## Table 2")[1])}
  small = rows[("ende", "T5-small", "0", "7")]
  c = t_q / t_p
  assert small[6] == f"{c:.3f}" and small[7] == f"{ratio[7]:.3f}"
  assert small[9] == f"{theory.walltime_improvement(0.75, 7, c):.2f}X"
  assert small[10] == f"{theory.expected_tokens(0.75, 7) / (7 * c + ratio[7]):.2f}X"
  base = rows[("ende", "T5-base", "0", "7")]
  assert base[6] == f"{0.5e-3 / t_p:.3f}"  # from the log line, not the shipped log
  assert rows[("ende", "T5-large", "0", "7")][9] == "n/a"  # no large step measured
  assert gpu_report.draft_steps(str(d / "missing.log")) == {}
  os.remove(d / "benchmark_gpu_xxl_small_b1.json")
  with pytest.raises(FileNotFoundError, match="b1.json"):
    gpu_report.report(str(d), "cmd")


def test_gpu_report_reads_step_variants_and_the_one_row_runs(tmp_path):
  """On a copy of the shipped H100 results: drafts' T_q from the newest "project" row of
  the step_variants files, t(8) from the XXL step row when the benchmark did not time
  gamma 7, the launch table, the one-row before / after and the copy-draft section."""
  import shutil
  from experiments import gpu_report
  src = os.path.join(setups.REPO_ROOT, "experiments", "results", "gpu_h100")
  d = tmp_path / "gpu"
  shutil.copytree(src, d, ignore=shutil.ignore_patterns("README.md"))
  text = open(gpu_report.main(["--dir", str(d)])).read()
  b1 = _json(d / "benchmark_gpu_xxl_small_b1.json")["summary"]
  t_p = b1["target_step"]["median"]
  base = [r for r in _json(d / "step_one_row_drafts.json")["rows"]
          if r["model"].startswith("t5_1_1_base") and r["variant"] == "project"][0]
  xxl = [r for r in _json(d / "step_one_row_xxl.json")["rows"] if r["variant"] == "project"][0]
  rows = {(r[0], r[1], r[2], r[3]): r for r in _rows_of(text.split("## Table 2")[1])}
  base_row = rows[("ende", "T5-base", "0", "7")]
  assert base_row[6] == f"{base['t_ms']['1'] / 1e3 / t_p:.3f}"
  assert base_row[7] == f"{xxl['t_ms']['8'] / xxl['t_ms']['1']:.3f}"  # t(8): the step row
  launches = _rows_of(text.split("## A step's kernel launches")[1])
  assert len(launches) == sum(len(_json(p)["rows"]) for p in d.glob("step_*.json"))
  before_after = {r[0]: r[1:] for r in _rows_of(text.split("## One-row products")[1])}
  before = _json(d / "benchmark_gpu_xxl_small_b1_one_row_as_one.json")["summary"]
  assert before_after["c"] == [f"{before['c']:.3f}", f"{b1['c']:.3f}"]
  copy = _json(d / "benchmark_gpu_xxl_copy_b1.json")["summary"]["e2e"]
  assert f"measured alpha {copy['alpha']:.3f}" in text
  for name in ("step_one_row_drafts.json", "step_one_row_xxl.json", "step_variants_drafts.json",
               "step_variants_large.json", "step_variants_xxl.json",
               "benchmark_gpu_xxl_copy_b1.json"):
    os.remove(d / name)
  text = open(gpu_report.main(["--dir", str(d)])).read()  # the engine plan's files alone
  assert "## A step's kernel launches" not in text and "known alpha" not in text


# ------------------------------------------------------------------ step variants
_HLO = """HloModule m

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%body.1 (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %g = f32[4]{0} custom-call(%f), custom_call_target="__cublas$gemm"
  %c = f32[4]{0} copy(%g)
  %b = f32[4]{0} bitcast(%c)
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %b)
}

%cond.1 (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %x)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond.1, body=%body.1
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_step_variants_counts_the_loop_bodys_launches():
  assert step_variants.loop_launches(_HLO) == {"fusions": 1, "custom_calls": 1, "other": 1,
                                               "total": 3}
  assert step_variants.computations(_HLO)["fused_a"] == ["parameter", "negate"]
  with pytest.raises(ValueError, match="no while loop"):
    step_variants.loop_launches(_HLO.replace("body=%body.1", ""))
  assert step_variants.variant_options("no_command_buffers+no_triton_gemm") == {
      "xla_gpu_enable_command_buffer": "", "xla_gpu_enable_triton_gemm": False}
  assert step_variants.variant_switches("one_row_as_two+project") == {"ONE_ROW_AS_TWO": True}
  with pytest.raises(ValueError, match="unknown variant 'fast'"):
    step_variants.variant_options("fast")
  assert step_variants.variant_switches("one_row_as_two_broadcast") == {
      "ONE_ROW_AS_TWO": "broadcast"}


def test_step_variants_sorts_launches_by_kind_and_tabulates_saved_modules(tmp_path, capsys):
  """launch_kinds: the loop body's launches by what they do (a fusion by kind and root,
  with the notable ops inside); --kinds tabulates saved modules side by side (gzip too)."""
  import gzip
  assert step_variants.launch_kinds(_HLO) == {"kLoop fusion, root negate": 1, "custom-call": 1,
                                              "copy": 1}
  concat = _HLO.replace("ROOT %n = f32[4]{0} negate(%p)",
                        "%n = f32[4]{0} negate(%p)\n  ROOT %q = f32[8]{0} concatenate(%n, %n)")
  a, b = tmp_path / "a.hlo", tmp_path / "b.hlo.gz"
  a.write_text(_HLO)
  with gzip.open(b, "wt") as f:
    f.write(concat)
  table = step_variants.main(["--kinds", f"{a},{b}"])
  assert "| kLoop fusion, root negate | 1 | 0 |" in table
  assert "| kLoop fusion, root concatenate (concatenate) | 0 | 1 |" in table
  assert table.endswith("| total | 3 | 3 |\n") and capsys.readouterr().out == table


def test_step_variants_tiny(out):
  """Two variants on a tiny model: each row timed and counted, the first repeated, the
  model switch back at its default after the run."""
  from spec_decode.models import t5
  paths = step_variants.main(["--models", "t5_1_1_tiny", "--vocab_size", "64",
                              "--input_length", "16", "--position", "8", "--tokens", "3",
                              "--repeats", "1", "--variants", "project,one_row_as_two",
                              "--save_hlo", "--results_dir", out["results"]])
  rows = _json(paths["json"])["rows"]
  assert [r["variant"] for r in rows] == ["project", "one_row_as_two", "project (again)"]
  for r in rows:
    assert set(r["t_ms"]) == {"1", "3"} and r["launches"]["total"] > 0
  assert t5.ONE_ROW_AS_TWO is None
  saved = sorted(f for f in os.listdir(out["results"]) if f.endswith(".hlo.gz"))
  assert saved == [f"step_variants_t5_1_1_tiny_random_{v}_n{n}.hlo.gz"
                   for v in ("one_row_as_two", "project") for n in (1, 3)], saved
  # the saved modules hold the loops that were counted
  table = step_variants.kinds_table([os.path.join(out["results"], f) for f in saved[:1]])
  assert table.endswith(f"| total | {rows[1]['launches']['total']} |\n")
  with pytest.raises(SystemExit):
    step_variants.main(["--variants", "fast", "--results_dir", out["results"]])


# ------------------------------------------------------------------ time_decodes
def test_time_decodes_warms_up_again_after_a_release_and_refuses_programs_that_do_not_fit(
    monkeypatch):
  """A release of the compiled programs while a later decoder compiles: every decoder is
  compiled again before the rounds. A release during the second warm-up or a timed round
  (the decoders' programs do not fit together; each timed call would compile): an error,
  not timings that include compiles."""
  from spec_decode.decoding import footprint
  released, calls = [0], []

  def decoder(name, drops_at):
    def f(enc, ids):
      calls.append(name)
      if len(calls) in drops_at:
        released[0] += 1
      return jnp.zeros(1)
    return f

  monkeypatch.setattr(footprint, "releases", lambda: released[0])
  batches = [(np.zeros((1, 4), np.int32), np.zeros(1, np.int32))] * 2
  out = harness.time_decodes({"a": decoder("a", ()), "b": decoder("b", (2,))}, batches,
                             repeats=2)
  assert calls[:4] == ["a", "b", "a", "b"]  # b's compile dropped a's: both warmed again
  assert len(calls) == 4 + 2 * 2 * 2 and all(len(t.seconds) == 2 for t in out.values())
  for drops_at, when in (((2, 4), "again while they compiled"), ((2, 7), "in timed round 1")):
    calls.clear()
    with pytest.raises(harness.ProgramsDoNotFit, match=f"2 decoders x 1 input lengths = 2 "
                       f"compiled programs do not fit together: the process dropped them {when}"):
      harness.time_decodes({"a": decoder("a", ()), "b": decoder("b", drops_at)}, batches,
                           repeats=2)


def test_gpu_demo_script_carries_the_target_in_two_calls(tmp_path):
  """experiments/gpu_demo.sh: the stash call keeps the first half where the run call looks
  for it, and a run call on a machine without it (given back in between) stops at once with
  exit 3 and says why, before installing or decoding anything."""
  import subprocess
  script = os.path.join(setups.REPO_ROOT, "experiments", "gpu_demo.sh")
  half = tmp_path / "tree" / ".xfer1" / "ende_target_big"
  half.mkdir(parents=True)
  (half / "checkpoint").write_text("first half")
  env = dict(os.environ, OUT=str(tmp_path / "out"), SPEC_DECODE_STASH=str(tmp_path / "stash"))
  run = lambda plan: subprocess.run(["bash", script, "abc123", plan], cwd=tmp_path / "tree",
                                    env=env, capture_output=True, text=True, timeout=60)
  missing = run("run")
  assert missing.returncode == 3 and "given back in between" in missing.stdout
  assert not (tmp_path / "tree" / "demo_models").exists()
  assert run("stash").returncode == 0
  assert (tmp_path / "stash" / "ende_target_big" / "checkpoint").read_text() == "first half"


def test_roofline_files_are_named_by_maker_and_vector_width():
  """Two CPUs of one model name (a virtual machine's "AMD EPYC") with different vector
  widths get result files of their own."""
  from experiments import roofline
  assert roofline.cpu_family("AMD EPYC (family 25, model 1)", ["avx2", "fma"]) == "amd_epyc_avx2"
  assert roofline.cpu_family("AMD EPYC (family 25, model 17)",
                             ["avx2", "fma", "avx512f", "avx512_bf16"]) == "amd_epyc_avx512"
  assert roofline.cpu_family("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6, model "
                             "143)", ["avx2", "avx512f", "amx_tile"]) == "intel_xeon_avx512"
  assert roofline.cpu_family("Neoverse-V2", []) == "neoverse_v2"


def test_cpu_model_names_its_x86_family_and_model():
  from spec_decode.kernels import cpu_matmul
  try:
    text = open("/proc/cpuinfo").read()
  except OSError:
    pytest.skip("no /proc/cpuinfo")
  first = text.split("\n\n")[0]
  fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  if "cpu family" not in fields:
    pytest.skip("not an x86 /proc/cpuinfo")
  assert cpu_matmul.cpu_info()["model"] == (
      f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})")


# ------------------------------------------------------------------ kernel variants
def test_kernel_variants_times_every_variant_at_every_row_count(tmp_path):
  from experiments import kernel_variants
  from spec_decode.kernels import cpu_matmul
  if cpu_matmul.describe()["kernel"] != "on":
    pytest.skip("the CPU kernel is off here")
  paths = kernel_variants.main(["--target", "demo:ende_target", "--rows", "1,3",
                                "--kernel_weights", "float32", "--repeats", "1",
                                "--name", "tiny", "--results_dir", str(tmp_path)])
  doc = json.loads(open(paths["json"]).read())
  rows = doc["rows"]
  assert [r["rows"] for r in rows] == [1, 3] and rows[0]["t_ratio"] == 1.0
  for r in rows:
    times = {v: r[f"ms_{v}"] for v in cpu_matmul.variants()}
    assert all(t > 0 for t in times.values())
    assert r["best"] == min(times, key=times.get) and r[f"over_{r['best']}"] == 1.0
  family = os.path.basename(paths["md"])
  assert family.startswith("kernel_variants_") and family.endswith("_tiny.md")
  # the decoder's matrices by shape, in the weight format asked for: each layer's MLP
  # output [mlp_dim, emb_dim] once per layer, and every matrix reads or writes emb_dim
  models = kernel_variants.harness.load_models("demo:ende_target")
  t = models.target
  shapes = kernel_variants.decoder_shapes(
      dataclasses.replace(t, kernel_weights="float32").decode_params(models.target_params))
  c = t.config
  assert shapes[(c.mlp_dim, c.emb_dim, "float32", False)] == c.num_decoder_layers
  assert {dtype for _, _, dtype, _ in shapes} == {"float32"}
  assert all(c.emb_dim in (K, N) for K, N, _, _ in shapes)


def test_kernel_ab_times_two_builds_of_the_kernel(tmp_path):
  from experiments import kernel_ab
  from spec_decode.kernels import cpu_matmul
  if cpu_matmul.describe()["kernel"] != "on":
    pytest.skip("the CPU kernel is off here")
  paths = kernel_ab.main(["--base_source", str(cpu_matmul._SOURCE), "--target",
                          "demo:ende_target", "--rows", "1,2", "--kernel_weights", "float32",
                          "--repeats", "1", "--name", "tiny", "--results_dir", str(tmp_path)])
  doc = json.loads(open(paths["json"]).read())
  rows = doc["rows"]
  assert [(r["placement"], r["rows"]) for r in rows] == [
      ("stream", 1), ("stream", 2), ("cache", 1), ("cache", 2)]
  for r in rows:
    assert r["base_ms"] > 0 and r["this_ms"] > 0
    assert r["ratio"] == pytest.approx(r["this_ms"] / r["base_ms"])
  assert os.path.basename(paths["md"]).startswith("kernel_ab_")
  assert doc["meta"]["kernel_ab"]["base"] == str(cpu_matmul._SOURCE)
  with pytest.raises(SystemExit, match="no-such-revision"):
    kernel_ab.measure(kernel_ab.parse_args(["--base", "no-such-revision", "--rows", "1"]))
  with pytest.raises(SystemExit):
    kernel_ab.parse_args(["--placements", "disk"])


def test_kernel_ab_decode_runs_the_base_build_in_the_same_process(tmp_path):
  """--placements decode: programs traced inside `base_targets` call the base library's
  handlers (registered under names of their own), those outside this checkout's; both give
  the same products here (the base is this source), and the decode row times both."""
  import jax
  import jax.numpy as jnp
  from experiments import kernel_ab
  from spec_decode.kernels import cpu_matmul
  if cpu_matmul.describe()["kernel"] != "on":
    pytest.skip("the CPU kernel is off here")
  _, base_path = kernel_ab.builds(cpu_matmul._SOURCE.read_text())
  kernel_ab.register_base(base_path)
  w = cpu_matmul.pack(np.random.RandomState(0).randn(64, 48).astype(np.float32))
  x = jnp.asarray(np.random.RandomState(1).randn(3, 64).astype(np.float32))
  product = lambda: jax.jit(lambda x: cpu_matmul.matmul(x, w))  # a fresh trace each time
  with kernel_ab.base_targets():
    base = product()
    base_text, base_y = base.lower(x).as_text(), base(x)
  this = product()
  this_text = this.lower(x).as_text()
  assert kernel_ab.BASE_PREFIX + "spec_decode_small_m_matmul" in base_text
  assert kernel_ab.BASE_PREFIX not in this_text and "spec_decode_small_m_matmul" in this_text
  np.testing.assert_array_equal(np.asarray(base_y), np.asarray(this(x)))
  assert cpu_matmul._target_prefix == ""  # restored
  # Through the model's jitted decode, as the decode placement times it: a loop compiled
  # inside the block keeps the base's handlers, and one made after it does not reuse the
  # decode traced there (before the fix it did, and the A/B timed the base build twice).
  from spec_decode.decoding import timing
  models = harness.load_models("demo:ende_target")
  enc = jnp.asarray(np.random.RandomState(0).randint(2, 100, (1, 8)).astype(np.int32))
  make = lambda: timing.decode_loop(models.target, models.target_params, enc, num_tokens=2,
                                    cache_length=10, steps=2, compiled=True)
  with kernel_ab.base_targets():
    base_loop = make()
  this_loop = make()
  kernel_ab.check_targets(base_loop.compiled_text(), base=True)
  kernel_ab.check_targets(this_loop.compiled_text(), base=False)
  with pytest.raises(RuntimeError, match="not only the base build's"):
    kernel_ab.check_targets(this_loop.compiled_text(), base=True)
  np.testing.assert_array_equal(np.asarray(base_loop()), np.asarray(this_loop()))
  paths = kernel_ab.main(["--base_source", str(cpu_matmul._SOURCE), "--target",
                          "demo:ende_target", "--rows", "2", "--kernel_weights", "float32",
                          "--placements", "decode", "--repeats", "2", "--name", "tiny",
                          "--results_dir", str(tmp_path)])
  (row,) = json.loads(open(paths["json"]).read())["rows"]
  assert (row["placement"], row["rows"]) == ("decode", 2)
  assert row["base_ms"] > 0 and row["this_ms"] > 0 and row["ratio"] > 0


def test_table4_flags_a_set_up_timed_longer_than_the_decode():
  """A run whose separately timed set-up exceeds its autoregressive seconds per example (two
  clocks that disagree: a tiny model under load) gets a note saying so in Table 4; a
  consistent one does not."""
  rows = reproduce.plan(4, reproduce._Args("tiny", "big", "paper", None, None, None, None,
                                           None, (), 0))
  row = next(r for r in rows if "run" in r.jobs)

  def entry(setup_seconds):
    return {"summary": {
        "completed": 2, "alpha": 0.6, "speedup_measured": 1.1, "mean_output_length": 8.0,
        "experiment": {"decoders": {"speculative": {"gamma": 3}}},
        "decoders": {"speculative": {"target_calls": 6}},
        "timing": {"target_step_seconds": 0.001, "verify_ratio": 1.2, "c": 0.1,
                   "autoregressive_seconds": 0.02, "speculative_seconds": 0.018,
                   "setup_seconds": {"target": setup_seconds}}}}

  for setup_seconds, flagged in ((0.002, False), (0.013, True)):  # AR: 10 ms per example
    _, out, _ = reproduce.render(4, [row], {row.jobs["run"].key: entry(setup_seconds)})
    (r,) = out
    np.testing.assert_allclose(r["setup_fraction"], setup_seconds / 0.010)
    assert ("set-up timed alone 1.30x" in r["note"]) == flagged, r["note"]
