"""The paper's analysis of speculative decoding as plain numpy functions.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023), section 3. Notation:
  beta   acceptance probability of a draft token at one prefix (section 3.1),
         sum_x min(p(x), q(x)) = 1 - D_LK(p, q) (section 3.2);
  alpha  expected acceptance rate E[beta] (section 3.1; Corollary 3.6 for its estimate);
  gamma  draft tokens proposed per target call;
  c      time of one draft run / time of one target run (the cost coefficient, section 3.3);
  c_hat  arithmetic operations of one draft run / those of one target run (section 3.4).

Every function accepts scalars or arrays and broadcasts them; a scalar in gives
a numpy float (or int) out. Bad values raise ValueError naming the argument.
"""

from __future__ import annotations

import numpy as np

_DEFAULT_MAX_GAMMA = 64


def _real(x, name: str, lo: float = -np.inf, hi: float = np.inf) -> np.ndarray:
  """x as a float64 array with every value in [lo, hi] (NaN rejected)."""
  try:
    arr = np.asarray(x, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} must be a real number or array of them, got {x!r}") from e
  if np.isnan(arr).any():
    raise ValueError(f"{name} must not be NaN, got {x!r}")
  if (arr < lo).any() or (arr > hi).any():
    raise ValueError(f"{name} must lie in [{lo}, {hi}], got {x!r}")
  return arr


def _alpha(alpha) -> np.ndarray:
  return _real(alpha, "alpha", 0.0, 1.0)


def _cost(c, name: str) -> np.ndarray:
  arr = _real(c, name, 0.0)
  if np.isinf(arr).any():
    raise ValueError(f"{name} must be finite, got {c!r}")
  return arr


def _gamma(gamma) -> np.ndarray:
  """gamma as an int64 array of values >= 1 (bools and floats rejected)."""
  arr = np.asarray(gamma)
  if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"gamma must be an int >= 1 (or an integer array), got {gamma!r}")
  arr = arr.astype(np.int64)
  if (arr < 1).any():
    raise ValueError(f"gamma must be >= 1, got {gamma!r}")
  return arr


def _out(x):
  """0-d arrays come back as numpy scalars."""
  return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


def expected_tokens(alpha, gamma):
  """Expected tokens produced per target call, (1 - alpha^(gamma+1)) / (1 - alpha).

  The paper's equation (1), under i.i.d. acceptance; gamma + 1 at alpha = 1.
  Computed as expm1((gamma+1) log alpha) / expm1(log alpha), which keeps full
  precision for alpha close to 1.
  """
  a, g = _alpha(alpha), _gamma(gamma)
  with np.errstate(divide="ignore", invalid="ignore"):
    log_a = np.log(a)
    ratio = np.expm1((g + 1) * log_a) / np.expm1(log_a)
  return _out(np.where(a == 1.0, (g + 1).astype(np.float64), ratio))


def walltime_improvement(alpha, gamma, c):
  """Expected walltime improvement factor over autoregressive decoding (Theorem 3.8).

  (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)): each target call costs
  one target run plus gamma draft runs of relative cost c.
  """
  c = _cost(c, "c")
  return _out(expected_tokens(alpha, gamma) / (_gamma(gamma) * c + 1.0))


def operations_factor(alpha, gamma, c_hat):
  """Expected factor of increase in arithmetic operations (Theorem 3.11).

  (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)): the target
  scores gamma + 1 positions per call, the draft runs gamma times.
  """
  c_hat = _cost(c_hat, "c_hat")
  g = _gamma(gamma)
  return _out((g * c_hat + g + 1.0) / expected_tokens(alpha, gamma))


def speculation_helps(alpha, c):
  """Whether some gamma >= 1 gives a walltime improvement > 1: exactly when alpha > c.

  Corollary 3.9 states the sufficiency (gamma = 1 then gives at least
  (1 + alpha) / (1 + c)). Necessity: 1 + alpha + ... + alpha^gamma <= 1 + gamma alpha,
  so with alpha <= c the factor of Theorem 3.8 is at most 1 for every gamma.
  """
  return _out(_alpha(alpha) > _cost(c, "c"))


def nondecreasing_costs(curve) -> dict:
  """A measured cost curve {N: cost of N tokens} fitted to be non-decreasing in N (least
  squares, pool-adjacent-violators): scoring more tokens in one call never costs less, so a
  dip in a measured curve is timing noise (a verify ratio of 2.2 at N = 10 and 1.5 at
  N = 11, say), which would otherwise decide a choice of gamma."""
  if not curve:
    raise ValueError("the cost curve is empty")
  sizes = sorted(curve)
  blocks = []  # [mean, count], merged while a block's mean exceeds the next one's
  for n in sizes:
    blocks.append([float(curve[n]), 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      (m1, c1), (m2, c2) = blocks[-2], blocks[-1]
      blocks[-2:] = [[(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]]
  fitted = [m for m, c in blocks for _ in range(c)]
  return dict(zip(sizes, fitted))


def cost_model_improvement(alpha, gamma, c, verify_ratio):
  """Expected walltime improvement when a verify call costs what was measured:
  E[tokens](alpha, gamma) / (gamma c + t(gamma + 1)), t(N) = T_verify(N) / T_p.

  Theorem 3.8 is the case t = 1 (scoring gamma + 1 tokens costs one step, as when
  the target is memory bound). verify_ratio: {N: t(N)} measured, interpolated linearly
  between measured N (`interpolate_cost`, no extrapolation).
  """
  c = _cost(c, "c")
  g = _gamma(gamma)
  t = np.vectorize(lambda n: interpolate_cost(verify_ratio, float(n)), otypes=[np.float64])(
      g + 1)
  if (t <= 0).any():
    raise ValueError(f"verify cost ratios must be > 0, got {dict(verify_ratio)}")
  return _out(expected_tokens(alpha, gamma) / (g * c + t))


def optimal_gamma(alpha, c, *, max_gamma: int = _DEFAULT_MAX_GAMMA, verify_ratio=None):
  """The integer gamma in [1, max_gamma] maximizing the expected improvement factor.

  Without verify_ratio, Theorem 3.8's factor (a verify call costs one step). The paper
  finds it numerically (its Figure 3); so does this, by evaluating every gamma (the
  factor is unimodal in gamma). With verify_ratio {N: T_verify(N) / T_p} measured for N
  from 2 to max_gamma + 1 (interpolated between measured N), the factor of
  `cost_model_improvement`, which charges what verifying gamma + 1 tokens costs where
  that is more than a step (compute-bound targets, batches). Ties go to the smallest
  gamma. When no gamma helps (alpha <= c, see `speculation_helps`) the result is still
  the best gamma, which is then 1 and its factor <= 1: callers decide whether to
  speculate at all. When Thm 3.8's factor keeps growing (c = 0 with alpha > 0, or
  alpha = 1 with c < 1) the result is max_gamma.
  """
  if not isinstance(max_gamma, (int, np.integer)) or isinstance(max_gamma, bool) \
      or max_gamma < 1:
    raise ValueError(f"max_gamma must be an int >= 1, got {max_gamma!r}")
  a, c = np.broadcast_arrays(_alpha(alpha), _cost(c, "c"))
  gammas = np.arange(1, int(max_gamma) + 1)
  if verify_ratio is None:
    factors = walltime_improvement(a[..., None], gammas, c[..., None])
  else:
    factors = cost_model_improvement(a[..., None], gammas, c[..., None], verify_ratio)
  return _out(gammas[np.argmax(factors, axis=-1)])


def _distributions(p, q):
  p = _real(p, "p")
  q = _real(q, "q")
  if p.shape != q.shape or p.ndim < 1:
    raise ValueError(f"p and q must be arrays [..., V] of the same shape, got {p.shape} "
                     f"and {q.shape}")
  for name, d in (("p", p), ("q", q)):
    if (d < 0).any() or not np.isfinite(d).all():
      raise ValueError(f"{name} must hold finite probabilities >= 0")
    sums = d.sum(axis=-1)
    if not np.allclose(sums, 1.0, rtol=0.0, atol=1e-5):
      raise ValueError(f"{name} must sum to 1 over its last axis; sums range over "
                       f"[{sums.min()}, {sums.max()}]")
  return p, q


def acceptance_probability(p, q, *, lenience: float = 1.0):
  """beta per position: the probability that a draft token x ~ q is accepted.

  p, q [..., V]: target and draft distributions. With lenience l = 1 this is
  sum_x min(p(x), q(x)) = 1 - TV(p, q) (section 3.2, Corollary 3.6). With
  l < 1 (the paper's lossy appendix A.5) a token is accepted with probability
  min(1, p / (l q)), so beta = sum_x min(p(x) / l, q(x)). Returns [...].
  """
  p, q = _distributions(p, q)
  if not (0.0 < lenience <= 1.0):
    raise ValueError(f"lenience must be in (0, 1], got {lenience!r}")
  return _out(np.minimum(p / lenience, q).sum(axis=-1))


def alpha_from_distributions(p, q, *, lenience: float = 1.0) -> float:
  """alpha = mean over all positions of beta (section 3.1), p, q [..., V].

  The paper measures alpha this way on prefixes generated by the target.
  """
  return float(np.mean(acceptance_probability(p, q, lenience=lenience)))


def interpolate_cost(curve, n: float) -> float:
  """A measured cost curve {N: cost of N tokens} at n, linear between measured N.

  Raises ValueError when n lies outside the measured range (no extrapolation).
  """
  if not curve:
    raise ValueError("the cost curve is empty")
  sizes = np.array(sorted(curve), dtype=np.float64)
  costs = np.array([curve[k] for k in sorted(curve)], dtype=np.float64)
  if not (sizes[0] <= n <= sizes[-1]):
    raise ValueError(f"{n} tokens lie outside the measured cost curve "
                     f"[{sizes[0]:g}, {sizes[-1]:g}]; measure it further")
  return float(np.interp(n, sizes, costs))


def tree_budget_choice(mass_at, verify_ratio, draft_cost, budgets=None) -> dict:
  """Sequoia-style budget of a best-first draft tree, chosen from the draft's confidences.

  A best-first tree of budget B holds the B nodes of highest draft path
  probability. Under SpecExec's rule the target's walk reaches a node with its
  own path probability; taking the draft's in its place, a budget-B tree yields
    E(B) = 1 + sum of the B largest node confidences        tokens per call
  (the extra token included), at a cost, in target steps, of
    cost(B) = draft_cost(B) + t(B + 1),   t(N) = T_verify(N) / T_p,
  so the predicted speedup over autoregressive decoding is E(B) / cost(B).

  mass_at [K]: mean over target calls of the i-th largest node confidence
    (`DecodeStats.draft_mass_at` / target_calls) from trees of budget K; their
    first B entries stand for the budget-B tree.
  verify_ratio: {N: t(N)} measured; interpolated linearly (`interpolate_cost`).
  draft_cost: callable B -> the drafter's time per call / T_p for budget B.
  budgets: candidate budgets (default 1 .. K).
  Returns {"budget": the best B, "expected_tokens", "cost", "speedup": {B: value}}.
  """
  mass = _real(mass_at, "mass_at", 0.0, 1.0)
  if mass.ndim != 1 or mass.size == 0:
    raise ValueError(f"mass_at must be a non-empty vector, got shape {mass.shape}")
  K = mass.size
  budgets = list(range(1, K + 1)) if budgets is None else [int(b) for b in budgets]
  bad = [b for b in budgets if not 1 <= b <= K]
  if not budgets or bad:
    raise ValueError(f"budgets must lie in [1, {K}] (the confidences' length), got {bad}")
  cum = 1.0 + np.cumsum(mass)
  expected = {b: float(cum[b - 1]) for b in budgets}
  cost = {b: float(draft_cost(b)) + interpolate_cost(verify_ratio, b + 1) for b in budgets}
  if any(not np.isfinite(v) or v <= 0 for v in cost.values()):
    raise ValueError(f"costs must be positive and finite, got {cost}")
  speedup = {b: expected[b] / cost[b] for b in budgets}
  best = max(budgets, key=lambda b: (speedup[b], -b))
  return {"budget": best, "expected_tokens": expected, "cost": cost, "speedup": speedup}
