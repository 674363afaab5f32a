"""Reading the repository's gin files in tests, as the command lines read them."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configured(path: str, configurable):
  """An instance of `configurable` as the gin file at `path` (relative to the repository
  root, which its includes and checkpoint paths are relative to) binds it."""
  import gin

  from spec_decode.cli import gin as gin_layer
  gin.clear_config()
  gin_layer.register_gin()
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    gin.parse_config_file(path)
    return gin.get_configurable(configurable)()
  finally:
    os.chdir(cwd)
    gin.clear_config()


def shipped_head(task: str, kind: str, configurable, load):
  """(training config, head, params) of the demo head `demo_models/<task>_<kind>` that
  `configs/demo/<task>_<kind>.gin` trains: checks the file exports it for the task's
  demo target, loads it with `load(path)` and checks it reads that target."""
  from spec_decode import checkpoints
  from spec_decode.models import t5
  cfg = configured(f"configs/demo/{task}_{kind}.gin", configurable)
  assert cfg.export_path == f"demo_models/{task}_{kind}"
  assert cfg.target_checkpoint == f"demo_models/{task}_target"
  head, params = load(os.path.join(ROOT, cfg.export_path))
  tcfg, _ = checkpoints.load(os.path.join(ROOT, cfg.target_checkpoint), dtype="float32")
  head.check_target(t5.T5(tcfg))
  return cfg, head, params
