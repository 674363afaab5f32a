"""Paths that are local directories or gs://bucket/... locations.

Local files use the file system; gs:// goes through TensorStore's own GCS
key-value store (no TensorFlow, no gcsfs), the same driver that reads the
arrays.
"""

from __future__ import annotations

import os
import posixpath
import re

import tensorstore as ts

from spec_decode.checkpoints.common import CheckpointError


def split_gcs(path: str) -> tuple[str, str] | None:
  """'gs://bucket/a/b' -> ('bucket', 'a/b'); None for a local path."""
  m = re.fullmatch(r"gs://([^/]+)/?(.*)", path, re.DOTALL)
  return (m.group(1), m.group(2)) if m else None


def is_gcs(path: str) -> bool:
  return split_gcs(path) is not None


def join(path: str, *parts: str) -> str:
  if is_gcs(path):
    return posixpath.join(path, *parts)
  return os.path.join(path, *parts)


def dirname(path: str) -> str:
  return posixpath.dirname(path) if is_gcs(path) else os.path.dirname(path)


def normalize(path) -> str:
  path = os.fspath(path)
  return path.rstrip("/") if is_gcs(path) else os.path.abspath(path)


def kvstore_spec(path: str) -> dict:
  """TensorStore kvstore spec of a location."""
  gcs = split_gcs(path)
  if gcs:
    return {"driver": "gcs", "bucket": gcs[0], "path": gcs[1]}
  return {"driver": "file", "path": path}


def _gcs_store(path: str):
  bucket, key = split_gcs(path)
  return ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result(), key


def read_bytes(path: str) -> bytes | None:
  """The file's contents, or None when it does not exist (or is a directory)."""
  if not is_gcs(path):
    if not os.path.isfile(path):
      return None
    with open(path, "rb") as f:
      return f.read()
  store, key = _gcs_store(path)
  result = store.read(key).result()
  return result.value if result.state == "value" else None


def read_head(path: str, size: int) -> bytes | None:
  """The first `size` bytes of a local file; the whole object for gs://."""
  if is_gcs(path):
    data = read_bytes(path)
    return None if data is None else data[:size]
  if not os.path.isfile(path):
    return None
  with open(path, "rb") as f:
    return f.read(size)


def write_bytes(path: str, data: bytes) -> None:
  if not is_gcs(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(data)
    return
  store, key = _gcs_store(path)
  store.write(key, data).result()


def is_file(path: str) -> bool:
  if not is_gcs(path):
    return os.path.isfile(path)
  store, key = _gcs_store(path)
  return key.encode() in store.list(ts.KvStore.KeyRange(key, key + "\0")).result()


def is_dir(path: str) -> bool:
  """Local: a directory. gs://: some object lies under the prefix."""
  if not is_gcs(path):
    return os.path.isdir(path)
  store, key = _gcs_store(path)
  prefix = key.rstrip("/") + "/"
  return bool(store.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result())


def check_empty_target(path: str) -> None:
  """Writers refuse to mix a new checkpoint into a non-empty local directory."""
  if not is_gcs(path) and os.path.isdir(path) and os.listdir(path):
    raise CheckpointError(f"cannot save into {path}: the directory exists and is not empty")
  if not is_gcs(path) and os.path.exists(path) and not os.path.isdir(path):
    raise CheckpointError(f"cannot save into {path}: it is a file")
