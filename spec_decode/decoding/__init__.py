"""Decoding algorithms over the `Decoder` protocol, run by one runner.

  decoding.run(decoding.Speculative(gamma=4), target, tparams, tokens, draft=d, draft_params=dp,
               max_decode_len=64, sampling=decoding.Sampling(temperature=1.0), rng=key)
  decoding.autoregressive(...), decoding.speculative(...)   # the same, as thin functions

Algorithms, drafters and verifiers are registered by name (`registry`).
"""

from spec_decode import compile_options
from spec_decode.decoding import registry
from spec_decode.decoding.algorithms import Autoregressive, Speculative, autoregressive, speculative
from spec_decode.decoding.drafters import (AdaptiveDrafter, Drafter, EagleDrafter,
                                           EagleTreeDrafter, LayerSkipDrafter, LookupDrafter,
                                           LookupTreeDrafter, MedusaDrafter, ModelDrafter,
                                           MtpDrafter, SampledTreeDrafter, TreeDrafter)
from spec_decode.decoding.runner import Algorithm, row_keys, run
from spec_decode.decoding.sampling import Sampling, sample_from
from spec_decode.decoding.types import (Committed, DecodeResult, DecodeStats, Proposal,
                                        Verdict)
from spec_decode.decoding.verifiers import (BlockVerifier, ChainVerifier, TreeRRSVerifier,
                                            TreeVerifier, Verifier)

compile_options.unroll_threefry_on_cpu()  # random draws in decoding loops: see its doc

__all__ = ["AdaptiveDrafter", "Algorithm", "Autoregressive", "BlockVerifier", "ChainVerifier",
           "Committed", "DecodeResult", "DecodeStats", "Drafter", "EagleDrafter",
           "EagleTreeDrafter", "LayerSkipDrafter", "LookupDrafter", "LookupTreeDrafter",
           "MedusaDrafter", "ModelDrafter", "MtpDrafter", "Proposal", "SampledTreeDrafter",
           "Sampling", "Speculative", "TreeDrafter", "TreeRRSVerifier", "TreeVerifier", "Verdict",
           "Verifier", "autoregressive", "registry", "row_keys", "run", "sample_from",
           "speculative"]
