"""The paper's Tables 1-5 (Leviathan, Kalman, Matias, ICML 2023), as data.

Transcribed from the paper (see the project's reference/paper.md); reproduce.py
prints our measurements next to these. Drafts are named as in
`experiments.setups` ('small' = T5-small, ...); tasks 'ende' / 'cnndm'.
"""

from __future__ import annotations

# Table 1 (c = c_hat = 0): alpha, gamma, operations factor, walltime improvement.
TABLE1 = (
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
)

# Table 2 (T5-XXL target, batch 1, TPU-v4) and Table 4 (its appendix version with c and
# Thm 3.8's prediction): task, draft, temperature, gamma, alpha, c, predicted, measured.
TABLE4 = (
    ("ende", "small", 0, 7, 0.75, 0.02, 3.2, 3.4),
    ("ende", "base", 0, 7, 0.80, 0.04, 3.3, 2.8),
    ("ende", "large", 0, 7, 0.82, 0.11, 2.5, 1.7),
    ("ende", "small", 1, 7, 0.62, 0.02, 2.3, 2.6),
    ("ende", "base", 1, 5, 0.68, 0.04, 2.4, 2.4),
    ("ende", "large", 1, 3, 0.71, 0.11, 2.0, 1.4),
    ("cnndm", "small", 0, 5, 0.65, 0.02, 2.4, 3.1),
    ("cnndm", "base", 0, 5, 0.73, 0.04, 2.6, 3.0),
    ("cnndm", "large", 0, 3, 0.74, 0.11, 2.0, 2.2),
    ("cnndm", "small", 1, 5, 0.53, 0.02, 1.9, 2.3),
    ("cnndm", "base", 1, 3, 0.55, 0.04, 1.8, 2.2),
    ("cnndm", "large", 1, 3, 0.56, 0.11, 1.6, 1.7),
)
# Table 2 is Table 4 without c and the prediction.
TABLE2 = tuple((task, draft, t, g, alpha, speed)
               for task, draft, t, g, alpha, _, _, speed in TABLE4)

# Table 3: target label, our task (None: models this project does not have), draft,
# alpha at t=0, alpha at t=1.
TABLE3 = (
    ("GPT-like 97M (lm1b)", None, "unigram", 0.03, 0.03),
    ("GPT-like 97M (lm1b)", None, "bigram", 0.05, 0.05),
    ("GPT-like 97M (lm1b)", None, "GPT-like 6M", 0.88, 0.89),
    ("T5-XXL EnDe", "ende", "unigram", 0.08, 0.07),
    ("T5-XXL EnDe", "ende", "bigram", 0.20, 0.19),
    ("T5-XXL EnDe", "ende", "small", 0.75, 0.62),
    ("T5-XXL EnDe", "ende", "base", 0.80, 0.68),
    ("T5-XXL EnDe", "ende", "large", 0.82, 0.71),
    ("T5-XXL CNNDM", "cnndm", "unigram", 0.13, 0.08),
    ("T5-XXL CNNDM", "cnndm", "bigram", 0.23, 0.16),
    ("T5-XXL CNNDM", "cnndm", "small", 0.65, 0.53),
    ("T5-XXL CNNDM", "cnndm", "base", 0.73, 0.55),
    ("T5-XXL CNNDM", "cnndm", "large", 0.74, 0.56),
    ("LaMDA 137B", None, "LaMDA 100M", 0.61, 0.57),
    ("LaMDA 137B", None, "LaMDA 2B", 0.71, 0.71),
    ("LaMDA 137B", None, "LaMDA 8B", 0.75, 0.74),
)

# Table 5 (lossy lenience l, EnDe, t = 1, T5-XXL target): alpha per draft and l.
LENIENCES = (1.0, 0.5, 0.3, 0.1)
TABLE5 = (
    ("unigram", (0.07, 0.10, 0.11, 0.16)),
    ("bigram", (0.19, 0.23, 0.25, 0.32)),
    ("small", (0.62, 0.71, 0.76, 0.84)),
    ("base", (0.68, 0.80, 0.83, 0.90)),
)

# The paper's gamma for a (task, draft, temperature) of Table 2; n-gram drafts have
# none in the paper (configs/paper uses 3, as here).
NGRAM_GAMMA = 3


NGRAM_DRAFTS = ("unigram", "bigram")


def paper_gamma(task: str, draft: str, temperature: int) -> int:
  """Table 2/4's gamma for (task, draft, temperature); NGRAM_GAMMA for n-gram drafts."""
  for row in TABLE4:
    if row[:3] == (task, draft, temperature):
      return row[3]
  if draft in NGRAM_DRAFTS and temperature in (0, 1) and any(r[0] == task for r in TABLE4):
    return NGRAM_GAMMA
  raise ValueError(f"the paper has no gamma for task {task!r}, draft {draft!r}, temperature "
                   f"{temperature!r}; known: {sorted({r[:3] for r in TABLE4})} and n-gram "
                   f"drafts {NGRAM_DRAFTS}")
