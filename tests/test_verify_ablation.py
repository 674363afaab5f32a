"""experiments/verify_ablation.py end to end at the tiny scale, and its summary arithmetic.

No assertion on a timing: the checks are the table's rows, greedy identity with
the baseline, the drafted-length column and the comparisons of the summary.
"""

import json

import pytest

from experiments import verify_ablation


@pytest.mark.slow
def test_tiny_run_writes_the_table(tmp_path):
  paths = verify_ablation.main([
      "--scale", "tiny", "--tasks", "ende", "--temperatures", "0", "--gammas", "2",
      "--max_gamma", "3", "--num_examples", "2", "--repeats", "1",
      "--results_dir", str(tmp_path)])
  with open(paths["json"], encoding="utf-8") as f:
    doc = json.load(f)
  rows = doc["rows"]
  assert [r["decoder"] for r in rows] == [
      "chain g2", "block g2", "schedule chain <= 3", "schedule block <= 3",
      "threshold chain <= 3", "threshold block <= 3", "tuned chain <= 3", "tuned block <= 3"]
  for r in rows:
    assert r["identical_fraction"] == 1.0  # greedy: every decoder reproduces the baseline
    assert 1.0 <= r["drafted_per_call"] <= r["gamma"]
    assert r["tokens_per_call"] >= 1.0 and r["speedup"] > 0
  assert rows[0]["drafted_per_call"] == 2.0  # a fixed gamma drafts gamma tokens per call
  comparisons = [s["comparison"] for s in doc["summary"]]
  assert "block vs chain, gamma 2" in comparisons
  assert "tuned vs best fixed gamma 2 (block)" in comparisons
  assert doc["meta"]["command"].startswith("python -m experiments.verify_ablation --scale tiny")
  assert "## Summary" in open(paths["md"], encoding="utf-8").read()


def test_summary_compares_block_with_chain_and_rules_with_the_best_gamma():
  def row(v, g, rule, tpc, speedup):
    return {"task": "ende", "temperature": 1.0, "verifier": v, "gamma": g, "rule": rule,
            "tokens_per_call": tpc, "speedup": speedup}
  rows = [row("chain", 3, "fixed", 2.0, 1.1), row("block", 3, "fixed", 2.1, 1.2),
          row("chain", 4, "fixed", 2.4, 1.3), row("block", 4, "fixed", 2.5, 1.0),
          row("chain", 8, "tuned", 2.2, 1.43)]
  out = {s["comparison"]: s for s in verify_ablation.summarize(rows)}
  assert out["block vs chain, gamma 3"]["delta_tokens_per_call"] == pytest.approx(0.1)
  assert out["block vs chain, gamma 4"]["speedup_ratio"] == pytest.approx(1.0 / 1.3)
  mean = out["block vs chain, mean over 2 gammas"]
  assert mean["delta_tokens_per_call"] == pytest.approx(0.1)
  assert mean["speedup_ratio"] == pytest.approx((1.2 / 1.1 + 1.0 / 1.3) / 2)
  tuned = out["tuned vs best fixed gamma 4 (chain)"]
  assert tuned["delta_tokens_per_call"] == pytest.approx(-0.2)
  assert tuned["speedup_ratio"] == pytest.approx(1.1)


def test_bad_arguments():
  for argv in (["--tasks", "wmt"], ["--threshold", "1.5"], ["--max_gamma", "0"],
               ["--temperatures", "-1"]):
    with pytest.raises(SystemExit):
      verify_ablation.parse_args(argv)
