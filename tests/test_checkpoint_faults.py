"""Faulty and hostile checkpoints: non-finite weights, paths leading outside, corrupt Orbax
files, absurd sizes. Each is refused with one CheckpointError line naming the problem and
where it is, before anything is allocated (or, for NaN/Inf, as the array is read), and the
overrides (allow_nonfinite, allow_outside_paths) load what a trusting user asks for."""

import inspect
import json
import os
import pickle
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode import checkpoints, partitioning
from spec_decode.checkpoints import common, hf, hf_names, msgpack_codec, t5x_legacy
from spec_decode.models import t5
from spec_decode.tree_util import flatten, unflatten

FORMATS = ("t5x", "orbax", "hf")
CONFIG = t5.T5Config.preset("t5_1_1_tiny")
BAD = "decoder/logits_dense/kernel"  # [32, 64]: 2048 values


@pytest.fixture(scope="module")
def params():
  return t5.T5(CONFIG).init(jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def nan_params(params):
  """params with 5 NaN and 1 -Inf in decoder/logits_dense/kernel."""
  flat = {k: np.asarray(v) for k, v in flatten(params).items()}
  bad = flat[BAD].copy()
  bad[0, :5] = np.nan
  bad[3, 7] = -np.inf
  flat[BAD] = bad
  return unflatten(flat)


# ---------------------------------------------------------------- non-finite weights
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_refuses_nonfinite_weights(tmp_path, nan_params, fmt):
  path = tmp_path / "c"
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"parameter {BAD} of the .* to write at {path} holds 6 non-finite "
                           r"values \(NaN or Inf\) of 2048.*pass allow_nonfinite=True to "
                           r"checkpoints.save"):
    checkpoints.save(path, CONFIG, nan_params, format=fmt)
  assert not path.exists()  # refused before anything is written


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_checkpoint_is_refused_unless_allowed(tmp_path, nan_params, fmt, caplog):
  path = tmp_path / "c"
  checkpoints.save(path, CONFIG, nan_params, format=fmt, allow_nonfinite=True)
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"parameter {BAD} of {fmt} checkpoint {path} holds 6 non-finite "
                           r"values \(NaN or Inf\) of 2048: .*Refusing to load it; pass "
                           r"allow_nonfinite=True to checkpoints.load"):
    checkpoints.load(path, dtype=jnp.float32)
  result = checkpoints.load(path, dtype=jnp.float32, allow_nonfinite=True)
  assert result.nonfinite == {BAD: 6} and result.allow_nonfinite and result.format == fmt
  assert f"{BAD} (6)" in caplog.text
  config, loaded = result  # still the (config, params) pair callers unpack
  assert config == CONFIG and result.config is config and result.params is loaded
  kernel = np.asarray(loaded["decoder"]["logits_dense"]["kernel"])
  assert np.isnan(kernel[0, :5]).all() and kernel[3, 7] == -np.inf
  assert np.isfinite(kernel).sum() == kernel.size - 6


def test_load_stays_backwards_compatible(tmp_path, params):
  checkpoints.save(tmp_path / "c", CONFIG, params)
  result = checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  assert isinstance(result, tuple) and len(result) == 2 and result[0] == CONFIG
  assert result.nonfinite == {} and result.allow_nonfinite is False
  assert inspect.signature(checkpoints.load).parameters["allow_nonfinite"].default is False
  # Still a pytree node holding (config, params), and it pickles with its attributes.
  assert len(jax.tree.leaves(result)) == len(jax.tree.leaves((CONFIG, params)))
  mapped = jax.tree.map(np.asarray, result)
  assert mapped.format == "t5x" and isinstance(mapped.params["decoder"]["decoder_norm"]["scale"],
                                               np.ndarray)
  again = pickle.loads(pickle.dumps(result))
  assert again.format == "t5x" and again.nonfinite == {} and again[0] == CONFIG


@pytest.mark.parametrize("fmt", FORMATS)
def test_mesh_load_counts_each_array_once_on_its_devices(tmp_path, nan_params, fmt,
                                                         monkeypatch):
  """One reduction per array, run on the sharded array itself (never gathered)."""
  mesh = partitioning.make_mesh("data=2,model=4")
  checkpoints.save(tmp_path / "c", CONFIG, nan_params, format=fmt, allow_nonfinite=True)
  reduced = []
  original = common._device_nonfinite
  monkeypatch.setattr(common, "_device_nonfinite",
                      lambda x: reduced.append(x.sharding) or original(x))
  with pytest.raises(checkpoints.CheckpointError, match=rf"{BAD} .* holds 6 non-finite"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float32, mesh=mesh)
  reduced.clear()
  result = checkpoints.load(tmp_path / "c", dtype=jnp.float32, mesh=mesh, allow_nonfinite=True)
  assert result.nonfinite == {BAD: 6}
  assert len(reduced) == len(flatten(nan_params))
  want = flatten(partitioning.param_shardings(t5.T5(CONFIG), mesh))
  for sharding, (name, array) in zip(reduced, flatten(result.params).items()):
    assert len(sharding.device_set) == 8
    assert array.sharding.is_equivalent_to(want[name], array.ndim), name
  assert reduced[list(flatten(result.params)).index(BAD)].spec == \
      jax.sharding.PartitionSpec(None, "model")


def test_host_memory_load_is_checked(tmp_path, nan_params):
  checkpoints.save(tmp_path / "c", CONFIG, nan_params, allow_nonfinite=True)
  with pytest.raises(checkpoints.CheckpointError, match=rf"{BAD} .* holds 6 non-finite"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float32, host_memory=True)
  result = checkpoints.load(tmp_path / "c", dtype=jnp.float32, host_memory=True,
                            allow_nonfinite=True)
  kernel = result.params["decoder"]["logits_dense"]["kernel"]
  assert kernel.sharding.memory_kind == "pinned_host" and result.nonfinite == {BAD: 6}


def test_values_beyond_the_loading_dtype_count(tmp_path, params):
  """float32 weights beyond float16's range become Inf when loaded as float16."""
  flat = {k: np.asarray(v) for k, v in flatten(params).items()}
  flat[BAD] = flat[BAD].copy()
  flat[BAD][1, 1] = 1e6
  checkpoints.save(tmp_path / "c", CONFIG, unflatten(flat))
  checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  with pytest.raises(checkpoints.CheckpointError, match=rf"{BAD} .* holds 1 non-finite"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float16)


def test_head_reader_and_writer_refuse_nonfinite(tmp_path, nan_params):
  """The calls the EAGLE/MTP heads make (t5x_legacy.write, open_arrays + materialize)."""
  flat = flatten(nan_params)
  with pytest.raises(checkpoints.CheckpointError, match=rf"{BAD} .* Refusing to write it"):
    t5x_legacy.write(str(tmp_path / "h"), flat, step=0)
  t5x_legacy.write(str(tmp_path / "h"), flat, step=0, allow_nonfinite=True)
  with pytest.raises(checkpoints.CheckpointError, match=rf"{BAD} .* Refusing to load it"):
    common.materialize(t5x_legacy.open_arrays(str(tmp_path / "h")), jnp.float32)


def test_model_spec_load_refuses_a_nan_target(tmp_path, nan_params):
  """As a decode target, a NaN checkpoint is refused instead of decoding into PAD tokens."""
  from spec_decode.experiment import model_specs
  checkpoints.save(tmp_path / "c", CONFIG, nan_params, allow_nonfinite=True)
  spec = model_specs.ModelSpec(checkpoint=str(tmp_path / "c"), dtype="float32")
  with pytest.raises(checkpoints.CheckpointError, match=rf"{BAD} .* holds 6 non-finite"):
    model_specs.load(spec, model_specs.LoadContext("target"))


def test_count_nonfinite():
  x = np.array([[1.0, np.nan], [np.inf, -np.inf]], np.float32)
  assert common.count_nonfinite(x) == 3
  assert common.count_nonfinite(jnp.asarray(x, jnp.bfloat16)) == 3
  assert common.count_nonfinite(np.arange(4)) == 0
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  assert common.count_nonfinite(jax.device_put(x, host)) == 3


# ---------------------------------------------------------------- paths leading outside
def _move_out(inside, outside):
  shutil.move(inside, outside)
  os.symlink(outside, inside)


def test_t5x_array_directory_linked_outside_is_refused(tmp_path, params):
  path = tmp_path / "checkpoint_1"
  checkpoints.save(path, CONFIG, params)
  name = "target.decoder.logits_dense.kernel"
  _move_out(path / name, tmp_path / "elsewhere")
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"names '{name}/', which is a symbolic link to {tmp_path}/elsewhere, "
                           r"outside the checkpoint .*allow_outside_paths=True"):
    checkpoints.load(path, dtype=jnp.float32)
  _, loaded = checkpoints.load(path, dtype=jnp.float32, allow_outside_paths=True)
  np.testing.assert_array_equal(loaded["decoder"]["logits_dense"]["kernel"],
                                params["decoder"]["logits_dense"]["kernel"])
  # Links that stay inside are followed, and so is a linked checkpoint directory.
  shutil.move(tmp_path / "elsewhere", path / "moved")
  os.remove(path / name)
  os.symlink(path / "moved", path / name)
  os.symlink(path, tmp_path / "link")
  for where in (path, tmp_path / "link", tmp_path / "link" / "checkpoint"):
    _, loaded = checkpoints.load(where, dtype=jnp.float32)
    np.testing.assert_array_equal(loaded["decoder"]["logits_dense"]["kernel"],
                                  params["decoder"]["logits_dense"]["kernel"])


def test_t5x_chunk_file_linked_outside_is_refused(tmp_path, params):
  path = tmp_path / "checkpoint_1"
  checkpoints.save(path, CONFIG, params)
  _move_out(path / "target.encoder.encoder_norm.scale" / "0", tmp_path / "chunk")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"target/encoder/encoder_norm/scale's array directory: .*/0 is a "
                           r"symbolic link to .*/chunk, outside the checkpoint"):
    checkpoints.load(path, dtype=jnp.float32)
  checkpoints.load(path, dtype=jnp.float32, allow_outside_paths=True)


def test_hf_index_shard_linked_outside_is_refused(tmp_path, params):
  directory = tmp_path / "hf"
  checkpoints.save(directory, CONFIG, params, format="hf")
  from safetensors import safe_open
  with safe_open(str(directory / "model.safetensors"), framework="np") as f:
    names = list(f.keys())
  shutil.move(directory / "model.safetensors", directory / "shard-1.safetensors")
  (directory / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {n: "shard-1.safetensors" for n in names}}))
  checkpoints.load(directory, dtype=jnp.float32)  # the index itself is fine
  _move_out(directory / "shard-1.safetensors", tmp_path / "stolen.safetensors")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"weight_map names 'shard-1.safetensors', which is a symbolic link "
                           rf"to {tmp_path}/stolen.safetensors, outside the checkpoint"):
    checkpoints.load(directory, dtype=jnp.float32)
  checkpoints.load(directory, dtype=jnp.float32, allow_outside_paths=True)


def test_hf_weights_linked_outside_are_refused_but_hub_cache_snapshots_load(tmp_path, params):
  directory = tmp_path / "hf"
  checkpoints.save(directory, CONFIG, params, format="hf")
  _move_out(directory / "model.safetensors", tmp_path / "other.safetensors")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"names 'model.safetensors', which is a symbolic link to "
                           r".*/other.safetensors, outside the checkpoint"):
    checkpoints.load(directory, dtype=jnp.float32)
  # The hub cache: <repo>/snapshots/<revision>/<file> -> ../../blobs/<hash>.
  repo = tmp_path / "models--t5" / "snapshots" / "abc123"
  repo.mkdir(parents=True)
  (tmp_path / "models--t5" / "blobs").mkdir()
  for name, blob in (("model.safetensors", "h1"), ("config.json", "h2")):
    shutil.copy(os.path.realpath(directory / name), tmp_path / "models--t5" / "blobs" / blob)
    os.symlink(f"../../blobs/{blob}", repo / name)
  _, loaded = checkpoints.load(repo, dtype=jnp.float32)
  np.testing.assert_array_equal(loaded["token_embedder"]["embedding"],
                                params["token_embedder"]["embedding"])


def test_orbax_file_linked_outside_is_refused(tmp_path, params):
  checkpoints.save(tmp_path / "c", CONFIG, params, format="orbax")
  _move_out(tmp_path / "c" / "state" / "d", tmp_path / "elsewhere")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"state/d is a symbolic link to .*/elsewhere, outside the checkpoint"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  checkpoints.load(tmp_path / "c", dtype=jnp.float32, allow_outside_paths=True)
  _move_out(tmp_path / "c" / "state", tmp_path / "state_elsewhere")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"names 'state', which is a symbolic link to .*/state_elsewhere"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float32)


# ---------------------------------------------------------------- corrupt Orbax checkpoints
def _write(path, data: bytes):
  path.write_bytes(data)


def _truncate(path):
  path.write_bytes(path.read_bytes()[:300])


ORBAX_FAULTS = {
    "garbage metadata": (lambda s: _write(s / "_METADATA", b"\x00\xffgarbage"),
                         r"_METADATA is corrupt, not valid JSON \(.*/state/_METADATA: 'utf-8'"),
    "truncated metadata": (lambda s: _truncate(s / "_METADATA"),
                           r"_METADATA is corrupt, not valid JSON \(.*Expecting"),
    "empty metadata": (lambda s: _write(s / "_METADATA", b""), r"_METADATA is empty"),
    "deeply nested metadata": (lambda s: _write(s / "_METADATA", b"[" * 100000),
                               r"_METADATA is corrupt, nested too deeply"),
    "metadata not a map": (lambda s: _write(s / "_METADATA", b"[1, 2]"),
                           r"_METADATA is corrupt, not a JSON object with a 'tree_metadata'"),
    "corrupt sharding": (lambda s: _write(s / "_sharding", b"\x00zz"),
                         r"_sharding is corrupt, not valid JSON"),
    "missing manifest": (lambda s: os.remove(s / "manifest.ocdbt"),
                         r"/.*/state/manifest.ocdbt is missing; the arrays' OCDBT store is "
                         r"incomplete"),
    "missing data directory": (lambda s: shutil.rmtree(s / "d"), r"/.*/state/d is missing"),
    "missing process directory": (lambda s: shutil.rmtree(s / "ocdbt.process_0"),
                                  r"/.*/state/ocdbt.process_0/manifest.ocdbt is missing"),
    "missing process data": (lambda s: shutil.rmtree(s / "ocdbt.process_0" / "d"),
                             r"/.*/state/ocdbt.process_0/d is missing"),
}


@pytest.mark.parametrize("fault", ORBAX_FAULTS)
def test_corrupt_orbax_checkpoint_is_named(tmp_path, params, fault):
  corrupt, message = ORBAX_FAULTS[fault]
  checkpoints.save(tmp_path / "c", CONFIG, params, format="orbax")
  corrupt(tmp_path / "c" / "state")
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"^Orbax checkpoint {tmp_path}/c/state: {message}") as e:
    checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_truncated_orbax_data_names_the_parameter(tmp_path, params):
  checkpoints.save(tmp_path / "c", CONFIG, params, format="orbax")
  for f in (tmp_path / "c" / "state" / "ocdbt.process_0" / "d").iterdir():
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"^parameter target/\w+/.* of Orbax checkpoint .*: restoring the "
                           r"parameters failed \(a missing, truncated or corrupt file in the "
                           r"checkpoint\?\): [A-Z_]+: Error reading") as e:
    checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)


def test_orbax_without_ocdbt_missing_array_directory(tmp_path, params):
  import orbax.checkpoint as ocp
  state = tmp_path / "c" / "state"
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
      state, args=ocp.args.PyTreeSave({"target": params,
                                        "state": {"step": np.asarray(0, np.int32)}}))
  checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  shutil.rmtree(state / "target.decoder.layers_0.mlp.wo.kernel")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"^parameter target/decoder/layers_0/mlp/wo/kernel of Orbax checkpoint "
                           rf"{state}: its array directory {state}/"
                           r"target.decoder.layers_0.mlp.wo.kernel is missing"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float32)


# ---------------------------------------------------------------- absurd sizes
HF_CONFIG = {"model_type": "t5", "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 64,
             "num_layers": 2, "num_heads": 4, "feed_forward_proj": "gated-gelu",
             "tie_word_embeddings": False}


@pytest.fixture
def hf_dir(tmp_path, params):
  checkpoints.save(tmp_path / "hf", CONFIG, params, format="hf")
  return tmp_path / "hf"


@pytest.fixture
def nothing_built(monkeypatch):
  """Fails a test that builds parameter names or opens weights before refusing."""
  def forbidden(*args, **kwargs):
    raise AssertionError("built or read before the sizes were checked")
  monkeypatch.setattr(hf_names, "param_names", forbidden)
  monkeypatch.setattr(hf, "_safetensors", forbidden)
  monkeypatch.setattr(common, "_read_cast", forbidden)


@pytest.mark.parametrize("change, message", [
    ({"num_layers": 10**6}, r"num_encoder_layers = 1000000 \(at most 1024\)"),
    ({"num_decoder_layers": 10**9}, r"num_decoder_layers = 1000000000 \(at most 1024\)"),
    ({"d_model": 10**9, "vocab_size": 10**12},
     r"vocab_size = 1000000000000 \(at most 4194304\), emb_dim = 1000000000"),
    ({"d_ff": 2**40}, r"mlp_dim = 1099511627776"),
    ({"num_heads": 10**5, "d_kv": 10**5}, r"num_heads = 100000 .*head_dim = 100000"),
    ({"layer_norm_epsilon": float("nan")}, r"layer_norm_epsilon = nan, expected a small"),
    ({"layer_norm_epsilon": [1e-6]}, r"layer_norm_epsilon = \[1e-06\], expected"),
    ({"feed_forward_proj": ["gated-gelu"]}, r"feed_forward_proj \['gated-gelu'\] is not"),
])
def test_absurd_hf_config_is_refused_before_allocation(hf_dir, nothing_built, change, message):
  (hf_dir / "config.json").write_text(json.dumps({**HF_CONFIG, **change}))
  start = time.monotonic()
  with pytest.raises(checkpoints.CheckpointError, match=message):
    checkpoints.load(hf_dir, dtype=jnp.float32)
  assert time.monotonic() - start < 5


def test_corrupt_hf_config_is_named(hf_dir, nothing_built, monkeypatch):
  config = hf_dir / "config.json"
  config.write_text('{"a": ' * 100000)
  with pytest.raises(checkpoints.CheckpointError, match=r"config.json nests too deeply"):
    checkpoints.load(hf_dir)
  config.write_bytes(b"\xff\xfe\x00garbage")
  with pytest.raises(checkpoints.CheckpointError, match=r"config.json is not valid JSON: 'utf-8'"):
    checkpoints.load(hf_dir)
  config.write_text("[32, 64]")
  with pytest.raises(checkpoints.CheckpointError, match=r"config.json holds a JSON list"):
    checkpoints.load(hf_dir)
  config.write_text(json.dumps(HF_CONFIG))
  monkeypatch.setattr(hf, "MAX_JSON_BYTES", 100)
  with pytest.raises(checkpoints.CheckpointError, match=r"config.json is \d+ bytes, more than"):
    checkpoints.load(hf_dir)


def test_t5x_layer_names_with_absurd_depth_are_refused(tmp_path, params, monkeypatch):
  """A msgpack naming layers_1048575 would otherwise build a million-layer model's shapes."""
  checkpoints.save(tmp_path / "c", CONFIG, params)
  file = tmp_path / "c" / "checkpoint"
  tree = msgpack_codec.decode(file.read_bytes())
  tree["optimizer"]["target"]["encoder"]["layers_1048575"] = {
      "pre_attention_layer_norm": {"scale": np.ones(32, np.float32)}}
  file.write_bytes(msgpack_codec.encode(tree))
  monkeypatch.setattr(common, "expected_shapes", lambda config: pytest.fail("shapes built"))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"t5x checkpoint .*: absurd model sizes num_encoder_layers = 1048576"):
    checkpoints.load(tmp_path / "c", dtype=jnp.float32)


def test_parameters_larger_than_memory_are_refused_before_reading(hf_dir, params, monkeypatch):
  monkeypatch.setattr("spec_decode.checkpoints.limits.host_available_bytes", lambda: 10_000)
  monkeypatch.setattr(common, "_read_cast", lambda *a: pytest.fail("read before the check"))
  count = sum(np.size(v) for v in jax.tree.leaves(params))
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"hf checkpoint {hf_dir}: its {count:,} parameters need 0.0 GiB as "
                           r"float32, more than the 0.0 GiB of available host memory; refusing"):
    checkpoints.load(hf_dir, dtype=jnp.float32)


def test_memory_capacity_of_accelerators():
  from spec_decode.checkpoints import limits

  class Device:
    platform = "gpu"

    def __init__(self, limit):
      self.limit = limit

    def memory_stats(self):
      return {"bytes_limit": self.limit}

  assert limits.memory_capacity([Device(80e9), Device(80e9)], host_memory=False) == (
      160_000_000_000, "memory of the 2 gpu device(s) used")
  with pytest.raises(checkpoints.CheckpointError, match=r"need 2.0 GiB as float32, more than "
                                                        r"the 1.0 GiB of memory of the 1 gpu"):
    limits.check_fits_memory({"a": (512, 1024, 1024)}, jnp.float32, where="x",
                             devices=[Device(2**30)])
  limits.check_fits_memory({"a": (512, 1024, 1024)}, jnp.bfloat16, where="x",
                           devices=[Device(2**30)])
