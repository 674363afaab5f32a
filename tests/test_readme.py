"""The README's library example runs as written (a newcomer's first lines of code)."""

import os
import re

import pytest

from spec_decode import paths


@pytest.mark.slow
def test_library_example_runs():
  text = open(os.path.join(paths.REPO_ROOT, "README.md"), encoding="utf-8").read()
  section = text[text.index("## Library"):]
  block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  scope: dict = {}
  exec(compile(block, "README.md (Library)", "exec"), scope)  # noqa: S102
  r = scope["r"]
  assert r.tokens.shape == (4, 32)
  assert {"LookupDrafter", "LayerSkipDrafter"} <= set(re.findall(r"decoding\.(\w+Drafter)", block))
