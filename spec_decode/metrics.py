"""Quality and acceptance metrics of an experiment.

Quality, with T5's settings (reference/t5x.md):
  * `bleu`: sacrebleu corpus BLEU, smooth 'exp', tokenize 'intl', no
    lowercasing, no effective order -> {'bleu'};
  * `rouge`: rouge_score ROUGE-1/2/Lsum F-measure x 100, the 'mid' of a
    bootstrap (1000 resamples) after turning " . " into " .\n" (so Lsum sees
    sentences) -> {'rouge1', 'rouge2', 'rougeLsum'}. The bootstrap is seeded
    (`seed`) so a score is reproducible; numpy's global random state is
    restored afterwards.
sacrebleu and rouge_score (the package's 'data' extra) are imported on use.

Acceptance, from the decoders' per-row counters (`decoding.DecodeStats`):
alpha observed (accepted / decisions), alpha estimated (mean beta =
min_pq_sum / decisions, the paper's definition), tokens per target call, and
acceptance by draft position (`per_position_acceptance`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

ROUGE_KEYS = ("rouge1", "rouge2", "rougeLsum")


def _check_pairs(targets: Sequence[str], predictions: Sequence[str]) -> tuple[list, list]:
  targets, predictions = list(targets), list(predictions)
  if len(targets) != len(predictions) or not targets:
    raise ValueError(f"need as many targets as predictions (and at least one), got "
                     f"{len(targets)} and {len(predictions)}")
  return targets, predictions


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Corpus BLEU of predictions against one reference each, T5's sacrebleu settings."""
  import sacrebleu
  targets, predictions = _check_pairs(targets, predictions)
  score = sacrebleu.corpus_bleu(predictions, [targets], smooth_method="exp", smooth_value=0.0,
                                force=False, lowercase=False, tokenize="intl",
                                use_effective_order=False)
  return {"bleu": float(score.score)}


def _sentence_lines(text: str) -> str:
  return text.replace(" . ", " .\n")


def rouge(targets: Sequence[str], predictions: Sequence[str], *,
          score_keys: Sequence[str] = ROUGE_KEYS, seed: int = 0) -> dict[str, float]:
  """ROUGE F-measures x 100 (bootstrap mid), T5's rouge_score settings."""
  from rouge_score import rouge_scorer, scoring
  targets, predictions = _check_pairs(targets, predictions)
  scorer = rouge_scorer.RougeScorer(list(score_keys))
  aggregator = scoring.BootstrapAggregator()
  for target, prediction in zip(targets, predictions):
    aggregator.add_scores(scorer.score(target=_sentence_lines(target),
                                       prediction=_sentence_lines(prediction)))
  state = np.random.get_state()
  try:
    np.random.seed(seed)
    result = aggregator.aggregate()
  finally:
    np.random.set_state(state)
  return {key: float(result[key].mid.fmeasure * 100) for key in score_keys}


def identical_fraction(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
  """Fraction of rows whose token sequences are equal."""
  if len(a) != len(b) or not len(a):
    raise ValueError(f"need two equally long non-empty lists of rows, got {len(a)} and {len(b)}")
  return float(np.mean([list(x) == list(y) for x, y in zip(a, b)]))


def alpha_estimate(*, min_pq_sum, decisions) -> float:
  """The paper's alpha from counters: sum min_pq_sum / sum decisions (NaN without decisions).

  The one place alpha is computed from `DecodeStats` (rows, runs or arrays of either).
  """
  n_dec = float(np.sum(np.asarray(decisions, np.float64)))
  return float(np.sum(np.asarray(min_pq_sum, np.float64)) / n_dec) if n_dec else float("nan")


def acceptance(*, accepted, decisions, min_pq_sum, target_calls, lengths) -> dict[str, float]:
  """Aggregate acceptance statistics over rows (each argument: per-row counts).

  alpha_observed = sum accepted / sum decisions (the acceptance rate of the
  rejection sampler); alpha_estimated = sum min_pq_sum / sum decisions (the
  mean of beta = sum_x min(p, q), the paper's alpha); tokens_per_target_call =
  tokens produced / target calls; accepted_per_target_call likewise.
  """
  acc, dec, mpq, calls, lens = (np.asarray(x, np.float64) for x in
                                (accepted, decisions, min_pq_sum, target_calls, lengths))
  n_dec, n_calls = dec.sum(), calls.sum()
  if (acc > dec).any() or (acc < 0).any() or (mpq > dec + 1e-3).any():
    raise ValueError("inconsistent counters: need 0 <= accepted <= decisions and "
                     "min_pq_sum <= decisions per row")
  nan = float("nan")
  return {
      "alpha_observed": float(acc.sum() / n_dec) if n_dec else nan,
      "alpha_estimated": alpha_estimate(min_pq_sum=mpq, decisions=dec),
      "tokens_per_target_call": float(lens.sum() / n_calls) if n_calls else nan,
      "accepted_per_target_call": float(acc.sum() / n_calls) if n_calls else nan,
      "decisions": int(n_dec),
      "target_calls": int(n_calls),
  }


def first_call_split(*, first_call_tokens, target_calls, lengths) -> dict[str, float]:
  """A row's first target call apart from its later ones (each argument: per-row counts;
  rows that made no call are left out): tokens_first_call = mean tokens its first call
  committed, tokens_per_later_call = the other tokens over the other calls (nan when no row
  made a second call). A drafter that proposes nothing on a first call (EAGLE or MTP before
  the target's first features) yields 1 there, and tokens_per_target_call mixes the two."""
  first, calls, lens = (np.asarray(x, np.float64) for x in (first_call_tokens, target_calls,
                                                              lengths))
  made = calls > 0
  if (first[made] < 1).any() or (first > lens).any() or (first[~made] != 0).any():
    raise ValueError("inconsistent counters: a row's first call commits 1 .. length tokens, "
                     "a row that made no call none")
  later = calls[made].sum() - made.sum()
  nan = float("nan")
  return {"tokens_first_call": float(first[made].mean()) if made.any() else nan,
          "tokens_per_later_call": float((lens[made].sum() - first[made].sum()) / later)
          if later else nan}


def per_position_acceptance(accepted: Sequence[int], reached: Sequence[int]) -> list:
  """Acceptance rate at each draft position (None where never decided).

  accepted, reached: per-position totals, e.g. DecodeStats.accepted_at and
  decided_at summed over rows.
  """
  accepted, reached = np.asarray(accepted, np.float64), np.asarray(reached, np.float64)
  if accepted.shape != reached.shape or (accepted > reached).any():
    raise ValueError("accepted and reached must have one shape, with accepted <= reached")
  return [float(a / r) if r else None for a, r in zip(accepted, reached)]


def quality(metric_fns, targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Union of the dicts each metric_fn(targets, predictions) returns."""
  out: dict[str, float] = {}
  for fn in metric_fns:
    result = fn(targets, predictions)
    if not isinstance(result, Mapping):
      raise ValueError(f"metric {fn!r} returned {type(result).__name__}, not a dict")
    out.update({k: float(v) for k, v in result.items()})
  return out
