"""Our T5X writer's checkpoints, read the way T5X reads them.

T5X is not a dependency, so each test below mirrors, with flax and tensorstore,
one step of T5X's own reading code (google-research/t5x: t5x/checkpoints.py,
t5x/state_utils.py, t5x/adafactor.py, t5x/utils.py), named in its docstring,
and checks our files against what that step needs. The last test runs T5X's
own loader, Checkpointer and restore recipe where `t5x` is importable.
"""

import os
import re

import jax
import numpy as np
import pytest
import tensorstore as ts
from flax import serialization, traverse_util

from spec_decode import checkpoints
from spec_decode.checkpoints import t5x_legacy
from spec_decode.models import t5
from spec_decode.tree_util import flatten, unflatten

# Both dimensions of every kernel >= 128 (T5X's min_dim_size_to_factor): factored
# Adafactor slots for the kernels, full v for the scales and position tables.
BIG = t5.T5Config.preset("t5_1_1_tiny", vocab_size=256, emb_dim=128, num_heads=8, head_dim=16,
                         mlp_dim=256, num_encoder_layers=2, num_decoder_layers=2)
TINY = t5.T5Config.preset("t5_1_1_tiny")  # every dimension < 128: full v everywhere
SLOTS = ("v_row", "v_col", "v", "m")


def _is_spec(_, value) -> bool:
  """t5x.state_utils.tensorstore_leaf."""
  return set(value.keys()) >= {"driver", "kvstore", "metadata"}


def _save(tmp_path, config, optimizer_state=None, seed=0):
  params = t5.T5(config).init(jax.random.PRNGKey(seed))
  path = tmp_path / "checkpoint_7"
  kwargs = {} if optimizer_state is None else {"optimizer_state": optimizer_state}
  checkpoints.save(path, config, params, format="t5x", step=7, **kwargs)
  contents = serialization.msgpack_restore((path / "checkpoint").read_bytes())
  return path, flatten(params), contents


def _read_like_t5x(path, spec: dict) -> np.ndarray:
  """t5x.checkpoints._read_ts: drop chunks and compressor, join the relative path with the
  checkpoint directory (_update_ts_path_from_relative_to_absolute), open, read."""
  spec = ts.Spec(spec).to_json()
  del spec["metadata"]["chunks"], spec["metadata"]["compressor"]
  spec["kvstore"]["path"] = os.path.join(os.path.dirname(path / "checkpoint"),
                                         spec["kvstore"]["path"])
  return ts.open(spec, open=True).result().read().result()


@pytest.mark.parametrize("optimizer_state", [None, "adafactor"])
def test_load_t5x_checkpoint_finds_only_arrays_and_specs(tmp_path, optimizer_state):
  """t5x.checkpoints.load_t5x_checkpoint flattens the state with
  flatten_state_dict(keep_empty_nodes=True), turns dict leaves into ts.Spec and
  pairs each leaf with a fake parameter info: an empty node (the empty
  param_states dict the writer used to store) gets an info whose counterpart is
  a dict, and the loader fails with "'dict' object has no attribute 'dtype'"."""
  path, params, contents = _save(tmp_path, TINY, optimizer_state)
  assert set(contents) == {"version", "optimizer"}  # checkpoint_utils.detect_checkpoint_type
  assert contents["version"] == 3
  flat = traverse_util.flatten_dict(contents["optimizer"], keep_empty_nodes=True,
                                    is_leaf=_is_spec, sep="/")
  empty = [k for k, v in flat.items() if v is traverse_util.empty_node]
  assert not empty, f"empty nodes T5X's loader cannot read: {empty}"
  assert int(flat.pop("state/step")) == 7 and np.asarray(contents["optimizer"]["state"]["step"]
                                                         ).dtype == np.int32
  for key, leaf in flat.items():
    assert isinstance(leaf, (dict, np.ndarray)), key
    if not isinstance(leaf, dict):
      continue
    # _maybe_update_ts_from_gcs_to_file reads kvstore['driver'] and pops kvstore['path'].
    assert leaf["kvstore"]["driver"] == "file" and "path" in leaf["kvstore"], key
    ts.Spec(leaf)
    value = _read_like_t5x(path, leaf)
    assert list(value.shape) == leaf["metadata"]["shape"], key  # _read_ts's shape check
    if key.startswith("target/"):
      np.testing.assert_array_equal(value, params[key[len("target/"):]], err_msg=key)
    else:
      assert not value.any(), key
  assert {k[len("target/"):] for k in flat if k.startswith("target/")} == params.keys()


def test_specs_are_written_in_t5xs_form(tmp_path):
  """t5x.checkpoints._get_spec names the array '<path with . for />' with a relative
  kvstore path; the msgpack holds ts.Spec(spec).to_json() (the ts.Spec
  serialization T5X registers), which adds the trailing '/' and the gzip level."""
  _, _, contents = _save(tmp_path, TINY)
  specs = traverse_util.flatten_dict(contents["optimizer"], is_leaf=_is_spec, sep="/")
  specs = {k: v for k, v in specs.items() if isinstance(v, dict)}
  assert len(specs) == len(flatten(t5.T5(TINY).param_shapes()))
  for key, spec in specs.items():
    assert spec == ts.Spec(spec).to_json(), key
    assert spec["kvstore"] == {"driver": "file", "path": key.replace("/", ".") + "/"}
    assert spec["metadata"]["compressor"] == {"id": "gzip", "level": 1}
  # gs://: T5X writes the dummy bucket and the path at the top level; its JSON form:
  t5x_gcs = ts.Spec({"driver": "zarr", "dtype": "float32", "path": "target.a.b",
                     "kvstore": {"driver": "gcs", "bucket": "t5x-dummy-bucket"},
                     "metadata": {"compressor": {"id": "gzip"}, "shape": [64, 32],
                                  "chunks": [64, 32]}}).to_json()
  assert t5x_legacy.array_spec("target/a/b", (64, 32), np.float32, gcs=True) == t5x_gcs


def _t5x_adafactor_slots(shape) -> dict:
  """t5x.adafactor.Adafactor.init_param_state with T5X's defaults (factored,
  min_dim_size_to_factor=128, beta1=None; T5's 2-D kernels fall back to the
  heuristic rule): factored second moments when both dimensions are >= 128,
  v_row over the smaller dimension and v_col over the larger (T5X drops the
  largest dimension for v_row); else the full v; unused slots are [1]."""
  slots = dict.fromkeys(SLOTS, (1,))
  if len(shape) == 2 and min(shape) >= 128:
    slots["v_row"], slots["v_col"] = (min(shape),), (max(shape),)
  else:
    slots["v"] = tuple(shape)
  return slots


@pytest.mark.parametrize("config", [BIG, TINY], ids=["factored", "unfactored"])
def test_adafactor_state_is_t5xs_zero_state(tmp_path, config):
  """A strict t5x.checkpoints.Checkpointer.restore with T5X's Adafactor: the
  checkpoint's state dict must hold every key of the train state's state dict
  (flax.serialization.from_state_dict raises on a missing key), and the slots
  must have the shapes Adafactor.init_param_state gives them. Adafactor's
  derive_logical_axes partitions only a full-size v, so T5X's Checkpointer
  writes v as a TensorStore array and v_row, v_col, m (and a [1] v) inline."""
  path, params, contents = _save(tmp_path, config, "adafactor")
  state = contents["optimizer"]["state"]
  want = {"target": unflatten({k: np.zeros(()) for k in params}),
          "state": {"step": np.zeros(()),
                    "param_states": unflatten({f"{k}/{s}": np.zeros(()) for k in params
                                               for s in SLOTS})}}
  serialization.from_state_dict(want, contents["optimizer"])  # raises on a missing key
  factored = 0
  slots = traverse_util.flatten_dict(state["param_states"], sep="/", is_leaf=_is_spec)
  assert len(slots) == 4 * len(params)
  for name, value in params.items():
    expected = _t5x_adafactor_slots(value.shape)
    factored += expected["v_row"] != (1,)
    for slot, shape in expected.items():
      leaf = slots[f"{name}/{slot}"]
      if slot == "v" and shape != (1,):
        assert isinstance(leaf, dict) and leaf["dtype"] == "float32", (name, slot)
        leaf = _read_like_t5x(path, leaf)
      else:
        assert isinstance(leaf, np.ndarray), (name, slot)
      assert leaf.shape == shape and leaf.dtype == np.float32 and not leaf.any(), (name, slot)
  kernels = len([k for k in params if k.endswith("kernel") or k == "token_embedder/embedding"])
  assert factored == (kernels if config is BIG else 0)  # position tables [8, 32]: full v


def test_documented_restore_recipe(tmp_path):
  """The restore recipe in t5x_legacy.write's docstring, run the way T5X runs it:
  utils.get_fallback_state refuses fallback_to_scratch without a state
  transformation (an assignment_map becomes one in RestoreCheckpointConfig);
  state_utils.apply_assignment_map (require_all_rules_match) must match every
  optimizer slot of T5X's Adafactor train state with a None replacement, and
  nothing else; the remaining keys must all be in the checkpoint."""
  doc = t5x_legacy.write.__doc__
  configs = re.findall(r"RestoreCheckpointConfig\((.*?)\)\n", doc, re.DOTALL)
  assert configs
  for cfg in configs:
    if "fallback_to_scratch=True" in cfg:
      assert "assignment_map=" in cfg or "state_transformation_fns=" in cfg, cfg
  scratch = [c for c in configs if "fallback_to_scratch=True" in c]
  assert len(scratch) == 1
  assignment_map = eval(re.search(r"assignment_map=(\(.*\)),?\s*$", scratch[0], re.DOTALL)
                        .group(1))
  _, params, contents = _save(tmp_path, BIG)
  model_keys = ([f"target/{k}" for k in params] + ["state/step"]
                + [f"state/param_states/{k}/{s}" for k in params for s in SLOTS])
  skipped, used = set(), set()
  for key in model_keys:
    for pattern, replacement in assignment_map:
      if re.fullmatch(pattern, key):
        assert replacement is None, (pattern, replacement)
        skipped.add(key)
        used.add(pattern)
        break
  assert used == {p for p, _ in assignment_map}
  assert skipped == {k for k in model_keys if k.startswith("state/param_states/")}
  in_checkpoint = set(traverse_util.flatten_dict(contents["optimizer"], is_leaf=_is_spec,
                                                 sep="/"))
  assert set(model_keys) - skipped <= in_checkpoint
  assert "strict=False, fallback_to_scratch=True)" not in doc


def test_optimizer_state_option_is_checked(tmp_path):
  config = TINY
  params = t5.T5(config).init(jax.random.PRNGKey(0))
  with pytest.raises(checkpoints.CheckpointError, match=r"unknown optimizer_state 'adam'"):
    checkpoints.save(tmp_path / "a", config, params, optimizer_state="adam")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"optimizer_state='adafactor' is written in T5X's legacy layout only"):
    checkpoints.save(tmp_path / "b", config, params, format="orbax", optimizer_state="adafactor")
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
  checkpoints.save(tmp_path / "c", config, params, optimizer_state="adafactor")
  _, loaded = checkpoints.load(tmp_path / "c", dtype=np.float32)  # our reader skips the state
  assert jax.tree.all(jax.tree.map(np.array_equal, loaded, params))


def test_t5x_itself_reads_our_checkpoints(tmp_path):
  """T5X's own code, where it is importable: load_t5x_checkpoint reads both layouts; a
  strict Checkpointer.restore reads them into an InferenceState and, from
  optimizer_state='adafactor', into an Adafactor train state equal to a fresh one;
  the documented recipe restores a train state from the plain layout."""
  t5x_checkpoints = pytest.importorskip("t5x.checkpoints")
  from flax.core import freeze, unfreeze
  from flax.linen import partitioning as flax_partitioning
  from t5x import adafactor, partitioning, train_state, utils
  axes = {"embedding": ("vocab", "embed"), "rel_embedding": ("heads", "relpos_buckets"),
          "scale": ("embed",), "query": ("embed", "joined_kv"), "key": ("embed", "joined_kv"),
          "value": ("embed", "joined_kv"), "out": ("joined_kv", "embed"),
          "wi_0": ("embed", "mlp"), "wi_1": ("embed", "mlp"), "wo": ("mlp", "embed"),
          "logits_dense": ("embed", "vocab")}
  plain, params, _ = _save(tmp_path / "plain", BIG)
  ada, _, _ = _save(tmp_path / "ada", BIG, "adafactor")
  names = {k: axes[k.split("/")[-1] if k.split("/")[-1] != "kernel" else k.split("/")[-2]]
           for k in params}
  variables = freeze({"params": unflatten(params), "params_axes": unflatten(
      {f"{k}_axes": flax_partitioning.AxisMetadata(names=v) for k, v in names.items()})})
  partitioner = partitioning.PjitPartitioner(
      num_partitions=1, logical_axis_rules=partitioning.standard_logical_axis_rules())

  def optimizer():
    return adafactor.Adafactor(decay_rate=0.8, step_offset=0,
                               logical_factor_rules=adafactor.standard_logical_factor_rules())

  def fresh():
    return train_state.FlaxOptimTrainState.create(optimizer(), variables)

  def restore(state_shape, path, **kwargs):
    return t5x_checkpoints.Checkpointer(state_shape, partitioner, str(path.parent)).restore(
        path=str(path), **kwargs)

  def assert_target(target):
    got = flatten(unfreeze(target))
    assert got.keys() == params.keys()
    for k in params:
      np.testing.assert_array_equal(got[k], params[k], err_msg=k)

  for path in (plain, ada):
    assert_target(t5x_checkpoints.load_t5x_checkpoint(str(path))["target"])
    inference = restore(jax.eval_shape(lambda: train_state.InferenceState.create(variables)),
                        path)
    assert_target(inference.params)
    assert int(inference.step) == 7
  trained = restore(jax.eval_shape(fresh), ada)
  assert_target(trained.params)
  jax.tree.map(np.testing.assert_array_equal, unfreeze(trained.param_states),
               unfreeze(fresh().param_states))
  cfg = eval(f"utils.RestoreCheckpointConfig(path=str(plain), mode='specific', "
             + re.search(r"mode='specific', (fallback_to_scratch=True,.*?\))\n",
                         t5x_legacy.write.__doc__, re.DOTALL).group(1))
  fallback = utils.get_fallback_state(cfg, lambda rng: fresh().state_dict(),
                                      jax.random.PRNGKey(1))
  resumed = restore(jax.eval_shape(fresh), plain,
                    state_transformation_fns=cfg.state_transformation_fns,
                    fallback_state=fallback)
  assert_target(resumed.params)
  assert int(resumed.step) == 7
