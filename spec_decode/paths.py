"""Where the repository is, and paths that configs name relative to it.

Configs name the shipped demo models (`demo_models/...`) and gin files relative to
the repository root, so commands run from any directory.
"""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_checkpoint(path) -> str:
  """`path` itself if it exists (or is a URL), else relative to the repository root if there."""
  path = os.fspath(path)
  if "://" in path or os.path.isabs(path) or os.path.exists(path):
    return path
  in_repo = os.path.join(REPO_ROOT, path)
  return in_repo if os.path.exists(in_repo) else path
