"""Hugging Face T5 directories: config.json + safetensors (or torch .bin) weights.

Reading: model.safetensors, a sharded model.safetensors.index.json,
pytorch_model.bin or pytorch_model.bin.index.json (torch imported only then).
Safetensors are read lazily per slice, so a mesh load reads only each shard.
Writing: config.json and one model.safetensors written with
`safetensors.numpy`; bfloat16 parameters are stored as safetensors BF16
(numpy's ml_dtypes.bfloat16), so bf16 round trips are exact and torch reads
them as torch.bfloat16. The output projection is written as lm_head.weight
unless the model uses logits_via_embedding (tied, scaled: T5 1.0).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import ml_dtypes
import numpy as np

from spec_decode.checkpoints import hf_names, storage
from spec_decode.checkpoints.common import (ArraySource, CheckpointError, check_finite,
                                            check_shapes, full_index, materialize, resolve_dtype)
from spec_decode.models import t5
from spec_decode.tree_util import unflatten

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
WEIGHT_FILES = (SAFETENSORS_FILE, "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json is ~1 KB, an index of 100k weights ~10 MB
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                       "BF16": ml_dtypes.bfloat16}

# An HF tensor: (shape, dtype, read(index) -> numpy block).
_Tensor = tuple[tuple[int, ...], np.dtype, Callable]


def _safetensors(file: str) -> dict[str, _Tensor]:
  from safetensors import safe_open
  try:
    handle = safe_open(file, framework="np")
  except Exception as e:
    raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e
  out = {}
  for name in handle.keys():
    view = handle.get_slice(name)
    kind = view.get_dtype()
    if kind not in _SAFETENSORS_DTYPES:
      raise CheckpointError(f"{file}: weight {name} has unsupported dtype {kind}")

    def read(index, view=view, name=name):
      try:
        return np.asarray(view[index])
      except Exception as e:
        raise CheckpointError(f"{file}: reading weight {name} failed: {e}") from e

    out[name] = (tuple(view.get_shape()), np.dtype(_SAFETENSORS_DTYPES[kind]), read)
  return out


def _torch_numpy(tensor) -> np.ndarray:
  import torch
  tensor = tensor.contiguous()
  if tensor.dtype == torch.bfloat16:
    return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.numpy()


def _torch_bin(file: str) -> dict[str, _Tensor]:
  try:
    import torch
  except ImportError as e:
    raise CheckpointError(f"{file} is a PyTorch checkpoint; reading it needs torch "
                          "(pip install torch), or convert it to safetensors") from e
  try:
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
  except Exception:  # the legacy (non-zip) format cannot be memory-mapped: read it whole
    try:
      state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
      raise CheckpointError(f"cannot read PyTorch checkpoint {file}: {e}") from e
  out = {}
  for name, tensor in state.items():
    dtype = _torch_numpy(tensor.reshape(-1)[:0]).dtype
    out[name] = (tuple(tensor.shape), dtype,
                 lambda index, tensor=tensor: _torch_numpy(tensor[index]))
  return out


def _hub_roots(directory: str) -> tuple[str, ...]:
  """A Hugging Face hub cache snapshot (<repo>/snapshots/<revision>/) holds symbolic
  links into <repo>/blobs/: the files of the checkpoint itself, allowed there."""
  real = os.path.realpath(directory)
  blobs = os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")
  if os.path.basename(os.path.dirname(real)) == "snapshots" and os.path.isdir(blobs):
    return (blobs,)
  return ()


def _check_file(directory: str, name: str, what: str, allow_outside_paths: bool) -> str:
  """directory/name, refused when the name (or a symbolic link) leads outside directory."""
  storage.check_inside(directory, name, what=what, allow_outside=allow_outside_paths,
                       extra_roots=_hub_roots(directory))
  return os.path.join(directory, name)


def _read_json(file: str) -> dict:
  """A JSON object from `file`, refused with a one-line error when corrupt or absurd."""
  size = os.path.getsize(file)
  if size > MAX_JSON_BYTES:
    raise CheckpointError(f"{file} is {size} bytes, more than any Hugging Face config or "
                          f"index ({MAX_JSON_BYTES}); refusing to parse it")
  try:
    with open(file, "rb") as f:
      contents = json.loads(f.read().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{file} is not valid JSON: {e}") from None
  except RecursionError:
    raise CheckpointError(f"{file} nests too deeply to be a Hugging Face config") from None
  if not isinstance(contents, dict):
    raise CheckpointError(f"{file} holds a JSON {type(contents).__name__}, not an object")
  return contents


def _open_tensors(directory: str, *, allow_outside_paths: bool = False) -> dict[str, _Tensor]:
  present = [f for f in WEIGHT_FILES if os.path.isfile(os.path.join(directory, f))]
  if not present:
    raise CheckpointError(f"HF checkpoint {directory} has no weights: expected one of "
                          f"{', '.join(WEIGHT_FILES)}")
  first = present[0]
  opener = _safetensors if "safetensors" in first else _torch_bin
  file = _check_file(directory, first, f"HF checkpoint {directory}", allow_outside_paths)
  if not first.endswith(".index.json"):
    return opener(file)
  weight_map = _read_json(file).get("weight_map", {})
  if not isinstance(weight_map, dict):
    raise CheckpointError(f"{file}: 'weight_map' is a {type(weight_map).__name__}, not a map")
  out = {}
  for shard in sorted(set(weight_map.values()), key=str):
    if not isinstance(shard, str) or not shard:
      raise CheckpointError(f"{first} names a weight file {shard!r}, which is not a file name")
    file = _check_file(directory, shard, f"{first}'s weight_map", allow_outside_paths)
    if not os.path.isfile(file):
      raise CheckpointError(f"{first} names the weight file {shard}, which is missing")
    out.update(opener(file))
  return out


def read_config(directory: str, *, allow_outside_paths: bool = False) -> dict:
  file = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(file):
    raise CheckpointError(f"not a Hugging Face checkpoint: {file} does not exist")
  return _read_json(_check_file(directory, CONFIG_FILE, f"HF checkpoint {directory}",
                                allow_outside_paths))


def _source(name: str, tensor: _Tensor, transposed: bool) -> ArraySource:
  shape, dtype, read = tensor
  if not transposed:
    return ArraySource(name, shape, dtype, read)
  if len(shape) != 2:
    raise CheckpointError(f"parameter {name}: expected a 2-D HF weight, got shape {shape}")
  return ArraySource(name, shape[::-1], dtype, lambda index: read(index[::-1]).T)


def _arrays(hf_config: dict, tensors: dict[str, _Tensor],
            where: str) -> tuple[t5.T5Config, dict[str, ArraySource]]:
  """Maps HF tensors onto T5X parameters, checking that nothing is missing or left over."""
  config, scaled = hf_names.config_from_hf(hf_config)
  names = hf_names.param_names(config)
  if "shared.weight" not in tensors:  # some exports keep only a stack's copy
    alias = next((n for n in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
                  if n in tensors), None)
    if alias:
      tensors = {**tensors, "shared.weight": tensors[alias]}
  extra_ok = set(hf_names.IGNORED_WEIGHTS)
  if "lm_head.weight" in tensors and "shared.weight" in tensors and scaled:
    lm_head, shared = (tensors[n] for n in ("lm_head.weight", "shared.weight"))
    if not np.array_equal(lm_head[2](full_index(lm_head[0])), shared[2](full_index(shared[0]))):
      raise CheckpointError(f"{where}: config.json scales decoder outputs (tied "
                            "embeddings) but lm_head.weight differs from shared.weight; "
                            "set tie_word_embeddings=false for an untied T5.1.1 model")
    extra_ok.add("lm_head.weight")
  if not scaled and "lm_head.weight" not in tensors:
    # Newer transformers tie lm_head to shared without scaling: T5X's untied
    # logits_dense holding the embedding's transpose.
    names["decoder/logits_dense/kernel"] = ("shared.weight", True)
  missing = sorted(f"{hf} (for {ours})" for ours, (hf, _) in names.items() if hf not in tensors)
  if missing:
    raise CheckpointError(f"HF checkpoint {where} is missing weights: "
                          + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
  used = {hf for hf, _ in names.values()}
  unexpected = sorted(set(tensors) - used - extra_ok)
  if unexpected:
    raise CheckpointError(f"HF checkpoint {where} has weights the T5 config does not "
                          f"use: {', '.join(unexpected[:8])}")
  sources = {ours: _source(ours, tensors[hf], transposed)
             for ours, (hf, transposed) in names.items()}
  return config, sources


def open_arrays(path: str, *, allow_outside_paths: bool = False
                ) -> tuple[t5.T5Config, dict[str, ArraySource]]:
  """(T5Config from config.json, {T5X parameter path: ArraySource}).

  Shard names of an index that lead outside the directory are refused unless
  allow_outside_paths.
  """
  directory = storage.normalize(path)
  if storage.is_gcs(directory):
    raise CheckpointError(f"Hugging Face checkpoints are read from local directories, "
                          f"not {directory}")
  hf_config = read_config(directory, allow_outside_paths=allow_outside_paths)
  hf_names.config_from_hf(hf_config, where=f"{directory}/{CONFIG_FILE}")  # before opening weights
  return _arrays(hf_config, _open_tensors(directory, allow_outside_paths=allow_outside_paths),
                 directory)


def from_state_dict(hf_config: dict, state_dict: dict, dtype=None, *,
                    allow_nonfinite: bool = False) -> tuple[t5.T5Config, dict]:
  """(T5Config, params) from an in-memory HF model: its `config.to_dict()` and
  `{name: numpy array}` state dict (e.g. `{k: v.numpy() for k, v in
  model.state_dict().items()}`). dtype and allow_nonfinite as in `checkpoints.load`."""
  tensors = {}
  for name, value in state_dict.items():
    value = np.asarray(value)
    tensors[name] = (value.shape, value.dtype, lambda index, value=value: value[index])
  config, sources = _arrays(hf_config, tensors, "state dict")
  dtype = resolve_dtype(dtype)
  config = config.replace(dtype=dtype)
  check_shapes(config, {n: s.shape for n, s in sources.items()}, what="HF state dict")
  return config, unflatten(materialize(sources, dtype, allow_nonfinite=allow_nonfinite,
                                       where="the HF state dict"))


def write(path: str, config: t5.T5Config, flat_params: dict, *,
          allow_nonfinite: bool = False) -> None:
  """Writes config.json and model.safetensors into directory `path`; a parameter
  holding NaN/Inf is refused (nothing is written) unless allow_nonfinite."""
  from safetensors.numpy import save_file
  directory = storage.normalize(path)
  if storage.is_gcs(directory):
    raise CheckpointError(f"Hugging Face checkpoints are written to local directories, "
                          f"not {directory}")
  check_finite(flat_params, allow=allow_nonfinite, where=f"the HF checkpoint to write at "
               f"{directory}", action="write", override="checkpoints.save")
  tensors = {}
  for ours, (hf, transposed) in hf_names.param_names(config).items():
    value = np.asarray(flat_params[ours])
    tensors[hf] = np.ascontiguousarray(value.T if transposed else value)
  dtype_name = np.dtype(tensors["shared.weight"].dtype).name
  hf_config = hf_names.config_to_hf(config, dtype_name)
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, SAFETENSORS_FILE), metadata={"format": "pt"})
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
