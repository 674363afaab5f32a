"""One process of the two-process decode in test_multihost.py (not collected by pytest).

Each process joins the run (`distributed.initialize_from_flags`), builds the
same tiny target/draft pair from fixed seeds, feeds only its own rows of the
encoder batch, runs greedy and sampled speculative decoding on a mesh spanning
both processes (the target model-parallel, the draft replicated), gathers the results
and (process 0) writes them to --out as .npz. With --mesh=none and one
process it is the unsharded single-process reference the test compares with.
"""

from __future__ import annotations

import jax
import numpy as np
from absl import app, flags

from spec_decode import decoding, distributed, partitioning
from spec_decode.models import t5

distributed.define_flags()
flags.DEFINE_string("mesh", "data=2,model=4",
                    "Mesh spec over all processes' devices; 'none' decodes unsharded.")
flags.DEFINE_string("out", None, "Where process 0 writes the gathered tokens (.npz).")
FLAGS = flags.FLAGS

GAMMA, MAX_LEN, BATCH = 3, 10, 4
SAMPLINGS = {"greedy": decoding.Sampling(), "sampled": decoding.Sampling(temperature=1.0)}


def make_case():
  """(target, target_params, draft, draft_params, encoder_tokens [BATCH, 6]) from fixed seeds.

  The draft is the target's architecture with noisy target weights, so some
  but not all of its proposals are accepted.
  """
  cfg = t5.T5Config.preset("t5_1_1_tiny", num_encoder_layers=1, num_decoder_layers=1)
  model = t5.T5(cfg)
  tp = model.init(jax.random.PRNGKey(0))
  leaves, treedef = jax.tree.flatten(tp)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  dp = jax.tree.unflatten(treedef, [x + 0.3 * x.std() * jax.random.normal(k, x.shape, x.dtype)
                                    for x, k in zip(leaves, keys)])
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(7), (BATCH, 6), 2, cfg.vocab_size))
  return model, tp, model, dp, tokens


def run(mesh, encoder_tokens) -> dict[str, decoding.DecodeResult]:
  """Greedy and sampled speculative decodes of `encoder_tokens` on `mesh` (None: unsharded)."""
  target, tp, draft, dp, _ = make_case()
  out = {}
  for name, sampling in SAMPLINGS.items():
    out[name] = decoding.speculative(target, tp, draft, dp, encoder_tokens, gamma=GAMMA,
                                     max_decode_len=MAX_LEN, sampling=sampling,
                                     rng=jax.random.PRNGKey(11), mesh=mesh)
  return out


def main(argv):
  del argv
  distributed.initialize_from_flags()
  tokens = make_case()[-1]
  if FLAGS.mesh == "none":  # the single-process, unsharded reference
    mesh, rows, encoder_tokens = None, slice(0, BATCH), tokens
  else:
    mesh = partitioning.make_mesh(FLAGS.mesh)
    rows = distributed.process_rows(mesh, BATCH)
    encoder_tokens = distributed.global_batch(tokens[rows], mesh, BATCH)  # only our rows
  results = distributed.gather(run(mesh, encoder_tokens))
  if jax.process_index() == 0:
    arrays = {f"{k}_tokens": r.tokens for k, r in results.items()}
    arrays.update({f"{k}_lengths": r.lengths for k, r in results.items()})
    arrays.update({f"{k}_accepted": r.stats.accepted for k, r in results.items()})
    arrays["process_count"] = np.int32(jax.process_count())
    arrays["device_count"] = np.int32(jax.device_count())
    arrays["rows_0"] = np.asarray([rows.start, rows.stop])
    np.savez(FLAGS.out, **arrays)


if __name__ == "__main__":
  app.run(main)
