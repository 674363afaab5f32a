"""Reading the repository's gin files in tests, as the command lines read them."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configured(path: str, configurable):
  """An instance of `configurable` as the gin file at `path` (relative to the repository
  root, which its includes and checkpoint paths are relative to) binds it."""
  import gin

  from spec_decode import main
  gin.clear_config()
  main.register_gin()
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    gin.parse_config_file(path)
    return gin.get_configurable(configurable)()
  finally:
    os.chdir(cwd)
    gin.clear_config()
