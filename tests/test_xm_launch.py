"""experiments/xm_launch.py: the job spec, --dry_run without xmanager or credentials, launch."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "xm_launch.py")


@pytest.fixture(scope="module")
def xml():
  spec = importlib.util.spec_from_file_location("xm_launch", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules["xm_launch"] = module  # dataclasses resolve annotations through sys.modules
  spec.loader.exec_module(module)
  yield module
  del sys.modules["xm_launch"]


def test_job_spec(xml):
  spec = xml.build_job_spec(gin_files=["configs/paper/cnndm_base_t1.gin"],
                            gin_bindings=["CHECKPOINT_PATH = 'gs://b/xxl'"],
                            output_dir="/gcs/b/out", tpu_type="v3", tpu_topology="2x2")
  assert spec.experiment_title == "spec_decode/cnndm_base_t1"
  assert spec.args == ("--gin_file=configs/paper/cnndm_base_t1.gin",
                       "--gin_bindings=CHECKPOINT_PATH = 'gs://b/xxl'",
                       "--output_dir=/gcs/b/out", "--noprogress")
  assert spec.requirements.chips == 4 and spec.requirements.cores == 8
  assert spec.requirements.resource == "TPU_V3"
  c = spec.container
  assert c.path == ROOT and c.entrypoint == ("python -m spec_decode.main",)
  assert c.docker_instructions[0] == f"COPY {os.path.basename(ROOT)}/ /workdir/spec_decode"
  assert any("pip install" in i and ".[data]" in i for i in c.docker_instructions)
  assert any("jax[tpu]" in i for i in c.docker_instructions)
  d = spec.to_json()
  assert d["requirements"]["xm_resource"] == "TPU_V3" and d["args"] == list(spec.args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tpu_type="v4"), "tpu_type must be one of"),
    (dict(tpu_topology="2y2"), "chip grid"),
    (dict(gin_files=["configs/nope.gin"]), "inside the repository"),
    (dict(gin_files=[os.path.join(ROOT, "configs/default.gin")]), "inside the repository"),
    (dict(gin_files=[]), "at least one --gin_file"),
    (dict(output_dir=None), "--output_dir is required"),
])
def test_job_spec_errors(xml, kwargs, match):
  args = dict(gin_files=["configs/default.gin"], gin_bindings=[], output_dir="/o",
              tpu_type="v3", tpu_topology="2x2")
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    xml.build_job_spec(**args)


def test_dry_run_cli_needs_no_xmanager_or_credentials(tmp_path):
  # A poisoned `xmanager` package first on the path proves --dry_run never imports it.
  poison = tmp_path / "xmanager"
  poison.mkdir()
  (poison / "__init__.py").write_text("raise RuntimeError('xmanager imported in a dry run')\n")
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("GOOGLE_", "GCLOUD", "CLOUDSDK"))}
  env["PYTHONPATH"] = str(tmp_path)
  proc = subprocess.run(
      [sys.executable, SCRIPT, "--dry_run", "--gin_file=configs/paper/ende_small_t0.gin",
       "--gin.CHECKPOINT_PATH='gs://b/xxl'", "--gin.DRAFT_CHECKPOINT_PATH='gs://b/small'",
       "--output_dir=/gcs/b/ende", "--tpu_type=v2", "--tpu_topology=2x2"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  spec = json.loads(proc.stdout)
  assert spec["args"] == ["--gin_file=configs/paper/ende_small_t0.gin",
                          "--gin_bindings=CHECKPOINT_PATH = 'gs://b/xxl'",
                          "--gin_bindings=DRAFT_CHECKPOINT_PATH = 'gs://b/small'",
                          "--output_dir=/gcs/b/ende", "--noprogress"]
  assert spec["requirements"] == {"tpu_type": "v2", "topology": "2x2", "chips": 4, "cores": 8,
                                  "xm_resource": "TPU_V2"}
  bad = subprocess.run([sys.executable, SCRIPT, "--dry_run", "--output_dir=/o"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "at least one --gin_file" in bad.stderr


def test_launch_builds_xmanager_objects(xml, monkeypatch):
  """`launch` against a recording stand-in for xmanager's xm / xm_local API."""
  calls = {}

  def record(name):
    return lambda *a, **k: calls.setdefault(name, []).append((a, k)) or (name, a, k)

  class Experiment:
    def package(self, packageables):
      calls["package"] = packageables
      return ["executable"]

    def add(self, job):
      calls["job"] = job

  xm = types.SimpleNamespace(
      Packageable=record("Packageable"), PythonContainer=record("PythonContainer"),
      CommandList=record("CommandList"), JobRequirements=record("JobRequirements"),
      Job=record("Job"), ResourceType={"TPU_V3": "tpu_v3_enum"})
  vertex = record("Vertex")
  vertex.Spec = record("VertexSpec")
  xm_local = types.SimpleNamespace(
      Vertex=vertex, create_experiment=lambda **k: contextlib.nullcontext(Experiment()))
  monkeypatch.setitem(sys.modules, "xmanager", types.SimpleNamespace(xm=xm, xm_local=xm_local))
  spec = xml.build_job_spec(gin_files=["configs/default.gin"], gin_bindings=[],
                            output_dir="/gcs/b/o", tpu_type="v3", tpu_topology="2x2")
  xml.launch(spec)
  [(_, pc)] = calls["PythonContainer"]
  assert pc["path"] == ROOT
  assert pc["docker_instructions"] == list(spec.container.docker_instructions)
  assert calls["CommandList"] == [((["python -m spec_decode.main"],), {})]
  assert calls["JobRequirements"] == [(({"tpu_v3_enum": 8},), {})]
  _, _, job = calls["job"]
  assert job["executable"] == "executable" and job["args"] == list(spec.args)
