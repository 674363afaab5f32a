"""The command lines, the only layer with absl flags and gin: each defines its flags when
it runs, never on import, so drivers and notebooks import the library freely.

  main     the experiment command (`python -m spec_decode.main`)
  train    the training command (`python -m spec_decode.cli.train`)
  memory   the memory planner (`python -m spec_decode.cli.memory`)
  gin      gin at the edge: registration of the configurable classes, strict parsing
  errors   one line per known error (exit code 2), quiet logging, progress lines
"""
