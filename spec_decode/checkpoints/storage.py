"""Paths that are local directories or gs://bucket/... locations.

Local files use the file system; gs:// goes through TensorStore's own GCS
key-value store (no TensorFlow, no gcsfs), the same driver that reads the
arrays. Every gs:// operation waits at most GCS_TIMEOUT_S seconds (environment
variable SPEC_DECODE_GCS_TIMEOUT_S, default 120) and then fails with a
CheckpointError naming the path: without network or credentials the GCS
driver would otherwise retry for many minutes without a word.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re

import tensorstore as ts

from spec_decode.checkpoints.common import CheckpointError

def _timeout_from_env(name: str = "SPEC_DECODE_GCS_TIMEOUT_S", default: float = 120.0) -> float:
  raw = os.environ.get(name)
  if raw is None:
    return default
  try:
    value = float(raw)
  except ValueError:
    value = float("nan")
  if not (0 < value < float("inf")):
    raise ValueError(f"environment variable {name} must be a positive number of seconds, "
                     f"got {raw!r}")
  return value


GCS_TIMEOUT_S = _timeout_from_env()


def wait(future, path: str, what: str = "reading"):
  """future.result(), bounded by GCS_TIMEOUT_S when `path` is on gs://."""
  if not is_gcs(path):
    return future.result()
  try:
    return future.result(timeout=GCS_TIMEOUT_S)
  except TimeoutError:
    future.cancel()
    raise CheckpointError(
        f"no answer from Google Cloud Storage within {GCS_TIMEOUT_S:g} s while {what} {path}: "
        "no network, or no credentials (gcloud auth application-default login)? Copy the "
        "checkpoint to a local directory, or raise SPEC_DECODE_GCS_TIMEOUT_S") from None


def split_gcs(path: str) -> tuple[str, str] | None:
  """'gs://bucket/a/b' -> ('bucket', 'a/b'); None for a local path."""
  m = re.fullmatch(r"gs://([^/]+)/?(.*)", path, re.DOTALL)
  return (m.group(1), m.group(2)) if m else None


def is_gcs(path: str) -> bool:
  return split_gcs(path) is not None


def join(path: str, *parts: str) -> str:
  if is_gcs(path):
    return posixpath.join(path, *parts)
  return os.path.normpath(os.path.join(path, *parts))


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
  return wait(ts.KvStore.open({"driver": "gcs", "bucket": bucket}), path, "opening"), key


def read_bytes(path: str) -> bytes | None:
  """The file's contents, or None when it does not exist (or is a directory)."""
  if not is_gcs(path):
    if not os.path.isfile(path):
      return None
    with open(path, "rb") as f:
      return f.read()
  store, key = _gcs_store(path)
  result = wait(store.read(key), path)
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
  wait(store.write(key, data), path, "writing")


def is_file(path: str) -> bool:
  if not is_gcs(path):
    return os.path.isfile(path)
  store, key = _gcs_store(path)
  return key.encode() in wait(store.list(ts.KvStore.KeyRange(key, key + "\0")), path, "listing")


def is_dir(path: str) -> bool:
  """Local: a directory. gs://: some object lies under the prefix."""
  if not is_gcs(path):
    return os.path.isdir(path)
  store, key = _gcs_store(path)
  prefix = key.rstrip("/") + "/"
  return bool(wait(store.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")), path, "listing"))


def check_empty_target(path: str) -> None:
  """Writers refuse to mix a new checkpoint into a non-empty local directory."""
  if not is_gcs(path) and os.path.isdir(path) and os.listdir(path):
    raise CheckpointError(f"cannot save into {path}: the directory exists and is not empty")
  if not is_gcs(path) and os.path.exists(path) and not os.path.isdir(path):
    raise CheckpointError(f"cannot save into {path}: it is a file")


_TRUST_HINT = ("pass allow_outside_paths=True to checkpoints.load, or "
               "ModelSpec.allow_outside_paths, if you trust it")


def fingerprint(path: str, *, small_file_bytes: int = 1 << 20) -> str | None:
  """A hash of what a local checkpoint (a directory or a file) holds: every file's relative
  path and size, and the content of files up to `small_file_bytes` (metadata, specs, and
  every chunk of a small model); larger files count by size only, so this stays fast on
  T5-XXL-sized checkpoints. None for remote (URL) and missing paths."""
  if "://" in path or not os.path.exists(path):
    return None
  digest = hashlib.sha256()
  files = ([path] if os.path.isfile(path) else
           sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names))
  for f in files:
    size = os.path.getsize(f)
    digest.update(f"{os.path.relpath(f, path)}\0{size}\0".encode())
    if size <= small_file_bytes:
      with open(f, "rb") as fh:
        digest.update(fh.read())
  return digest.hexdigest()[:16]


def _within(root: str, path: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def outside_target(base: str, path: str, extra_roots: tuple[str, ...] = ()) -> str | None:
  """Where local `path` really is (symbolic links followed, os.path.realpath) when
  that lies outside the real `base` and every `extra_roots`; None when inside."""
  real = os.path.realpath(path)
  roots = [os.path.realpath(r) for r in (base, *extra_roots)]
  return None if any(_within(root, real) for root in roots) else real


def check_inside(base: str, relative: str, *, what: str, allow_outside: bool = False,
                 extra_roots: tuple[str, ...] = ()) -> None:
  """Refuses a path from a checkpoint's metadata that leads outside the checkpoint.

  `relative` comes from a file in the checkpoint (a T5X TensorStore spec, an HF
  index): an absolute path, a URL or '..' would make loading read elsewhere,
  and so would a symbolic link on the way: a local path is resolved
  (os.path.realpath, of the checkpoint `base` too) before the check.
  `extra_roots` are other directories the path may resolve into.
  allow_outside=True accepts it (for a checkpoint you trust that points at shared arrays).
  """
  if allow_outside:
    return
  parts = relative.replace("\\", "/").split("/")
  if os.path.isabs(relative) or "://" in relative or ".." in parts:
    raise CheckpointError(f"{what} names {relative!r}, which lies outside the checkpoint "
                          f"{base}; refusing to read it ({_TRUST_HINT})")
  if not is_gcs(base):
    real = outside_target(base, os.path.join(base, relative), extra_roots)
    if real is not None:
      raise CheckpointError(f"{what} names {relative!r}, which is a symbolic link to {real}, "
                            f"outside the checkpoint {base}; refusing to read it ({_TRUST_HINT})")


def check_links_inside(base: str, directory: str, *, what: str,
                       allow_outside: bool = False) -> None:
  """Refuses a local `directory` of the checkpoint `base` holding a symbolic link
  (at any depth) that leads outside `base`: its reader would follow it."""
  if allow_outside or is_gcs(directory) or not os.path.isdir(directory):
    return
  for root, dirs, files in os.walk(directory):  # does not descend into linked directories
    for name in (*dirs, *files):
      entry = os.path.join(root, name)
      if os.path.islink(entry) and (real := outside_target(base, entry)) is not None:
        raise CheckpointError(f"{what}: {entry} is a symbolic link to {real}, outside the "
                              f"checkpoint {base}; refusing to read it ({_TRUST_HINT})")
