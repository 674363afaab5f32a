"""Offloaded targets (SpecExec's setting): parameters in host memory, streamed per layer.

Oracles: a streamed T5 (`stream_params=True`, params from `offload.to_host`)
computes what the resident one does: encoder, cache, decode with tree masks,
teacher forcing, and whole decodes (greedy autoregressive, chain and tree
speculative, sampled speculative with a fixed key) on one device and on a mesh.
On XLA:CPU the transfers compile to nothing, so that the weights stay streamed
inside the decode loop is checked on the program lowered for GPU: every
host-to-device transfer of the target's decode sits in the while loop's body,
tied by an optimization barrier to an activation (so XLA cannot hoist it).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tiers import tiered
from spec_decode import checkpoints, decoding, partitioning
from spec_decode.decoding import runner
from spec_decode.experiment import model_specs
from spec_decode.models import offload, t5

PRESET = "t5_1_1_tiny"
ENC = np.array([[5, 9, 13, 2, 7, 0], [3, 3, 40, 11, 0, 0]], np.int32)  # one padded row
DEC = np.array([[0, 4, 8, 15, 16], [0, 23, 42, 2, 9]], np.int32)


@functools.lru_cache(maxsize=None)
def _models():
  """(resident target, streamed target, params, host params, draft, draft params)."""
  config = t5.T5Config.preset(PRESET)
  params = t5.T5(config).init(jax.random.PRNGKey(0))
  draft = t5.T5(t5.T5Config.preset(PRESET, num_encoder_layers=1, num_decoder_layers=1))
  return (t5.T5(config), t5.T5(config, stream_params=True), params, offload.to_host(params),
          draft, draft.init(jax.random.PRNGKey(1)))


def _kinds(tree):
  """Memory kinds of a tree of arrays or of shardings."""
  return {getattr(x, "sharding", x).memory_kind for x in jax.tree.leaves(tree)}


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- placement
def test_to_host_places_every_leaf_in_host_memory_keeping_its_sharding():
  _, _, params, host, _, _ = _models()
  assert _kinds(params) == {"device"} and _kinds(host) == {"pinned_host"}
  _close(host, params)
  assert offload.is_on_host(host) and not offload.is_on_host(params)
  mesh = partitioning.make_mesh("data=2,model=2")
  sharded = jax.device_put(np.ones((4, 6), np.float32),
                           NamedSharding(mesh, PartitionSpec(None, "model")))
  out = offload.to_host({"w": sharded, "b": np.zeros(3, np.float32)}, "unpinned_host")
  assert out["w"].sharding == sharded.sharding.with_memory_kind("unpinned_host")
  assert out["b"].sharding.memory_kind == "unpinned_host"
  assert offload.off_host_paths({"w": sharded, "b": out["b"], "n": np.ones(2)}) == [
      "['n']", "['w']"]


def test_to_host_rejects_a_memory_kind_that_is_not_host_or_not_offered(monkeypatch):
  with pytest.raises(ValueError, match="memory_kind must be one of"):
    offload.to_host({"w": np.ones(2)}, "device")
  monkeypatch.setattr(offload, "_memory_kinds", lambda device: ["device"])  # a backend without
  with pytest.raises(ValueError, match=r"offers no 'pinned_host' memory.*offers \['device'\]"):
    offload.to_host({"w": np.ones(2)})


def test_streamed_model_computes_what_the_resident_one_does():
  model, streamed, params, host, _, _ = _models()
  _close(streamed.forward(host, ENC, DEC), model.forward(params, ENC, DEC))
  encoded = model.encode(params, ENC)
  s_encoded = streamed.encode(host, ENC)
  _close(s_encoded, encoded)
  cache, s_cache = model.init_cache(params, encoded, 12), streamed.init_cache(host, s_encoded, 12)
  _close(s_cache, cache)
  out, s_out = model.decode(params, cache, DEC[:, :2]), streamed.decode(host, s_cache, DEC[:, :2])
  _close(s_out, out)
  # A draft tree after the prefix: root, two children of the root, a grandchild.
  tree_mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
  tree = dict(positions=np.array([[2, 3, 3, 4]] * 2, np.int32),
              tree_mask=np.broadcast_to(tree_mask, (2, 4, 4)))
  _close(streamed.decode(host, s_out.cache, DEC[:, 1:], **tree),
         model.decode(params, out.cache, DEC[:, 1:], **tree))
  hidden = out.hidden
  _close(streamed.logits_from_hidden(host, hidden), model.logits_from_hidden(params, hidden))
  _close(streamed.embed(host, DEC), model.embed(params, DEC))


def test_streamed_t5_1_0_ties_logits_to_the_streamed_embedding():
  # Three layers each: a layer's weights wait for the layer two back (one of prefetch).
  model = t5.T5(t5.T5Config.preset("t5_tiny", num_encoder_layers=3, num_decoder_layers=3))
  params = model.init(jax.random.PRNGKey(2))
  streamed = t5.T5(model.config, stream_params=True)
  _close(streamed.forward(offload.to_host(params), ENC, DEC), model.forward(params, ENC, DEC))


def test_stream_params_must_be_a_bool():
  with pytest.raises(ValueError, match="stream_params must be True or False"):
    t5.T5(t5.T5Config.preset(PRESET), stream_params=1)


# --------------------------------------------------------------------------- decoding
_TREE = decoding.Speculative(gamma=1, drafter=decoding.TreeDrafter(budget=6, width=2, expand=2,
                                                                   depth=3, steps=2),
                             verifier=decoding.TreeVerifier())


def _run(algorithm, streamed: bool, **kw):
  model, s_model, params, host, draft, dparams = _models()
  drafts = dict(draft=draft, draft_params=dparams) if algorithm.needs_draft else {}
  target, tparams = (s_model, host) if streamed else (model, params)
  return decoding.run(algorithm, target, tparams, ENC, max_decode_len=8, **drafts, **kw)


@functools.lru_cache(maxsize=None)
def _greedy_tokens() -> np.ndarray:
  """The resident target's greedy output (autoregressive), which every exact algorithm
  reproduces token for token (tests/test_tree.py and test_speculative.py check that)."""
  return np.asarray(_run(decoding.Autoregressive(), streamed=False).tokens)


@pytest.mark.parametrize("algorithm", tiered([decoding.Autoregressive(), _TREE],
                                              fast=("autoregressive",),
                                              ids=["autoregressive", "tree"]))
def test_greedy_decoding_with_a_streamed_target_is_token_identical(algorithm):
  np.testing.assert_array_equal(_run(algorithm, streamed=True).tokens, _greedy_tokens())


@pytest.mark.slow
def test_sampled_speculative_decoding_with_a_streamed_target_is_token_identical():
  kw = dict(sampling=decoding.Sampling(temperature=1.0), rng=jax.random.PRNGKey(7))
  algorithm = decoding.Speculative(gamma=3)
  want, got = _run(algorithm, streamed=False, **kw), _run(algorithm, streamed=True, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)
  assert 0 < int(np.sum(want.stats.accepted)) < int(np.sum(want.stats.decisions))


def test_streamed_target_on_a_mesh_stays_in_host_memory_and_decodes_the_same():
  model, s_model, params, host, draft, dparams = _models()
  mesh = partitioning.make_mesh("data=2,model=2")
  algorithm = decoding.Speculative(gamma=3)
  _, in_shardings = runner.sharded(algorithm, s_model, draft, mesh, batch_shape=ENC.shape,
                                   max_decode_len=8, sampling=decoding.Sampling(),
                                   target_params=host, draft_params=dparams)
  assert _kinds(in_shardings[0]) == {"pinned_host"} and _kinds(in_shardings[1]) == {"device"}
  assert any(s.spec != PartitionSpec() for s in jax.tree.leaves(in_shardings[0]))
  got = decoding.run(decoding.Autoregressive(), s_model, host, ENC, max_decode_len=8, mesh=mesh)
  np.testing.assert_array_equal(got.tokens, _greedy_tokens())


def test_a_streamed_target_with_params_on_the_device_is_refused():
  _, s_model, params, _, _, _ = _models()
  with pytest.raises(ValueError, match=r"target streams its parameters .* not in host memory"
                                       r".*offload\.to_host\(params\)"):
    decoding.run(decoding.Autoregressive(), s_model, params, ENC, max_decode_len=4)


# --------------------------------------------------------------------------- the program
def _functions(text: str) -> dict[str, list[str]]:
  """{name: body lines} of a StableHLO module's top-level functions."""
  funcs, name = {}, None
  for line in text.splitlines():
    m = re.match(r"  func\.func \w+ @([\w.$-]+)\(", line)
    if m:
      name = m.group(1)
      funcs[name] = []
    elif line == "  }":
      name = None
    elif name is not None:
      funcs[name].append(line)
  return funcs


def _transfers(text: str):
  """(in_loop, all) host-to-device transfers (annotate_device_placement custom calls) of a
  StableHLO module, each as (function, operand); a transfer is in a loop when it is in a
  while body or in a function called, at any depth, from one. Also the optimization
  barriers' result names per function."""
  funcs = _functions(text)
  loop_calls, in_loop, every, barriers = set(), [], [], {}
  for name, lines in funcs.items():
    open_bodies = []  # indentation of the `} do {` lines of the while bodies we are in
    for line in lines:
      indent = len(line) - len(line.lstrip())
      if open_bodies and indent == open_bodies[-1] and line.lstrip().startswith("}"):
        open_bodies.pop()
      m = re.match(r"\s*(%[\w]+)(:\d+)? = stablehlo\.optimization_barrier", line)
      if m:
        barriers.setdefault(name, set()).add(m.group(1))
      for operand in re.findall(r"@annotate_device_placement\((%[\w#]+)\)", line):
        every.append((name, operand))
        if open_bodies:
          in_loop.append((name, operand))
      if open_bodies:
        loop_calls.update(re.findall(r"call @([\w.$-]+)\(", line))
      if line.strip() == "} do {":
        open_bodies.append(indent)
  reached, todo = set(), list(loop_calls)
  while todo:
    f = todo.pop()
    if f in reached or f not in funcs:
      continue
    reached.add(f)
    todo.extend(re.findall(r"call @([\w.$-]+)\(", "\n".join(funcs[f])))
  in_loop += [t for t in every if t[0] in reached and t not in in_loop]
  return in_loop, every, barriers


def test_transfers_stay_inside_the_decode_loop_tied_to_activations():
  model, s_model, params, host, draft, dparams = _models()
  args = (host, dparams, jnp.asarray(ENC), jnp.asarray(ENC), jax.random.PRNGKey(0),
          np.arange(2, dtype=np.int32))
  static = dict(algorithm=decoding.Speculative(gamma=3), target=s_model, draft=draft,
                max_decode_len=8, sampling=decoding.Sampling(temperature=1.0))
  jitted = runner._unsharded_jit(())
  # XLA:CPU keeps host and device memory in one RAM and lowers the transfers to nothing;
  # the program for GPU has them (as XLA's host offloader reads them).
  text = jitted.trace(*args, **static).lower(lowering_platforms=("cuda",)).as_text()
  in_loop, every, barriers = _transfers(text)
  per_decode = len(jax.tree.leaves(params["decoder"])) + 1  # and the token embedding
  assert len(in_loop) >= per_decode
  # Each is tied: its operand is an optimization barrier's result (the weights and an
  # activation), so it can neither leave the loop nor start before that activation.
  untied = [(f, op) for f, op in every if op.split("#")[0] not in barriers.get(f, ())]
  assert not untied
  # Only the target streams: the draft's and the resident target's programs move nothing.
  resident = jitted.trace(params, *args[1:], **dict(static, target=model)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "annotate_device_placement" not in resident
  assert "optimization_barrier" not in resident
  # On CPU the compiled program still takes the target's parameters from host memory
  # (layout memory space S(5)), all of them, and the draft's from device memory.
  compiled = jitted.lower(*args, **static).compile().as_text()
  layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled).group(1)
  assert layout.count("S(5)") == len(jax.tree.leaves(params))


# --------------------------------------------------------------------------- ModelSpec
def test_model_spec_offload_loads_a_streamed_target_that_decodes_the_same():
  model, _, params, _, _, _ = _models()
  spec = model_specs.ModelSpec(preset=PRESET, seed=0, offload=True)
  loaded, host = model_specs.load(spec, model_specs.LoadContext("target"))
  assert loaded.stream_params and loaded.config == model.config
  assert _kinds(host) == {"pinned_host"}
  _close(loaded.forward(host, ENC, DEC), model.forward(params, ENC, DEC))
  assert spec.to_json()["offload"] is True
  assert "offload" not in model_specs.ModelSpec(preset=PRESET).to_json()


@pytest.mark.parametrize("fmt", ["t5x", "orbax", "hf"])
def test_offloaded_checkpoint_is_read_into_host_memory(tmp_path, fmt):
  model, _, params, _, _, _ = _models()
  path = str(tmp_path / fmt)
  checkpoints.save(path, model.config, params, format=fmt)
  loaded, host = model_specs.load(model_specs.ModelSpec(checkpoint=path, offload=True),
                                  model_specs.LoadContext("target"))
  assert loaded.stream_params and _kinds(host) == {"pinned_host"}
  _close(loaded.forward(host, ENC, DEC), model.forward(params, ENC, DEC))


def test_model_spec_offload_is_validated():
  with pytest.raises(ValueError, match="offload must be True or False"):
    model_specs.ModelSpec(preset=PRESET, offload="yes")
  with pytest.raises(ValueError, match="'ngram' model cannot be offloaded"):
    model_specs.ModelSpec(kind="ngram", offload=True)
