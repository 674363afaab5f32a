"""The two test tiers (pytest.ini registers the `slow` marker).

`python -m pytest -q -m "not slow"` is the fast tier for development: unit tests, argument
checks, one small chi-square case per verifier and drafter family, the greedy-identity
checks. The slow tier adds the full chi-square power (every case and negative control),
training, subprocesses and the end-to-end drivers; `python -m pytest -q` runs both.
"""

import pytest


def tiered(values, fast, ids=None) -> list:
  """pytest parameters of `values` (a tuple is one case's arguments): the cases whose value,
  or id when `ids` are given, is in `fast` run in the fast tier, the rest are marked slow."""
  cases = []
  for i, value in enumerate(values):
    key = value if ids is None else ids[i]
    cases.append(pytest.param(*(value if isinstance(value, tuple) else (value,)),
                              marks=() if key in fast else (pytest.mark.slow,),
                              id=None if ids is None else ids[i]))
  return cases
