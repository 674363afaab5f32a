r"""Launches a spec_decode experiment on Cloud TPU (Vertex AI) through XManager.

  python experiments/xm_launch.py \
    --gin_file=configs/paper/ende_small_t0.gin \
    --gin.CHECKPOINT_PATH="'gs://BUCKET/t5_1_1_xxl_ende/checkpoint_N'" \
    --gin.DRAFT_CHECKPOINT_PATH="'gs://BUCKET/t5_1_1_small_ende/checkpoint_N'" \
    --gin.ExperimentConfig.mesh="'data=1,model=8'" \
    --output_dir=/gcs/BUCKET/spec_decode/ende_small_t0 \
    --tpu_type=v3 --tpu_topology=2x2 [--dry_run]

The job builds a container from this repository (copied in and installed with
`pip install .[data]` plus jax[tpu]), then runs `python -m spec_decode.main`
with the gin files, the gin bindings and --output_dir passed through. Vertex
AI mounts Cloud Storage under /gcs/BUCKET, so an output_dir there survives the
job and a relaunch with the same output_dir resumes the experiment.

--gin_file, --gin_bindings / --gin.NAME=VALUE and --output_dir are
spec_decode.main's own flags. --dry_run prints the job spec as JSON and needs
neither xmanager nor Google Cloud credentials. A real launch needs
`pip install xmanager` (kept out of setup.py: it pins protobuf < 7) and
XManager's GCP setup (gcloud auth, GOOGLE_CLOUD_BUCKET_NAME, ...). The spec
mirrors XManager's concepts: `ContainerSpec` is an `xm.PythonContainer`,
`TpuRequirements` an `xm.JobRequirements`, `JobSpec` an `xm.Job` with its
args; `launch` converts them.

TPU types: XManager's Vertex executor provides Cloud TPU v2 and v3 slices
(machine type 'cloud-tpu', 2 cores per chip); --tpu_topology is the chip grid,
e.g. 2x2 = 4 chips = 8 cores (a v3-8).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Sequence

from absl import app, flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_TYPES = {"v2": "TPU_V2", "v3": "TPU_V3"}  # XManager ResourceType names (Vertex AI)
CORES_PER_CHIP = 2
DEFAULT_BASE_IMAGE = "python:3.11-slim"
JAX_TPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
  """What xm.PythonContainer builds: `path` copied into `base_image`, then `entrypoint`."""
  path: str
  base_image: str
  docker_instructions: tuple[str, ...]
  entrypoint: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TpuRequirements:
  """What xm.JobRequirements asks for: one TPU slice of `tpu_type` with chip grid `topology`."""
  tpu_type: str
  topology: str

  def __post_init__(self):
    if self.tpu_type not in TPU_TYPES:
      raise ValueError(f"tpu_type must be one of {sorted(TPU_TYPES)} (XManager's Vertex AI "
                       f"executor), got {self.tpu_type!r}")
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", self.topology or ""):
      raise ValueError(f"tpu_topology must be a chip grid like '2x2', got {self.topology!r}")

  @property
  def chips(self) -> int:
    n = 1
    for d in self.topology.split("x"):
      n *= int(d)
    return n

  @property
  def cores(self) -> int:
    return self.chips * CORES_PER_CHIP

  @property
  def resource(self) -> str:
    return TPU_TYPES[self.tpu_type]


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """One experiment job: its container, TPU, and the command-line args of spec_decode.main."""
  experiment_title: str
  container: ContainerSpec
  requirements: TpuRequirements
  args: tuple[str, ...]

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["requirements"].update(chips=self.requirements.chips, cores=self.requirements.cores,
                             xm_resource=self.requirements.resource)
    return json.loads(json.dumps(d))  # tuples -> lists: the JSON-native form


def container_spec(*, path: str = REPO_ROOT, base_image: str = DEFAULT_BASE_IMAGE) -> ContainerSpec:
  """The project installed in a container (XManager copies `path`'s parent as build context)."""
  name = os.path.basename(os.path.normpath(path))
  return ContainerSpec(
      path=path, base_image=base_image,
      docker_instructions=(
          f"COPY {name}/ /workdir/spec_decode",
          "WORKDIR /workdir/spec_decode",
          "RUN pip install --no-cache-dir '.[data]'",
          f"RUN pip install --no-cache-dir 'jax[tpu]' -f {JAX_TPU_RELEASES}",
      ),
      entrypoint=("python -m spec_decode.main",))


def main_args(*, gin_files: Sequence[str], gin_bindings: Sequence[str],
              output_dir: str) -> tuple[str, ...]:
  """Flags of spec_decode.main; each is one argv item (no shell quoting needed)."""
  if not gin_files:
    raise ValueError("at least one --gin_file is required")
  for f in gin_files:
    if os.path.isabs(f) or not os.path.exists(os.path.join(REPO_ROOT, f)):
      raise ValueError(f"gin file {f!r} must be a path inside the repository (it is read "
                       f"from the container's copy), relative to {REPO_ROOT}")
  if not output_dir:
    raise ValueError("--output_dir is required (e.g. /gcs/BUCKET/spec_decode/NAME)")
  return (*(f"--gin_file={f}" for f in gin_files),
          *(f"--gin_bindings={b}" for b in gin_bindings),
          f"--output_dir={output_dir}", "--noprogress")


def build_job_spec(*, gin_files: Sequence[str], gin_bindings: Sequence[str], output_dir: str,
                   tpu_type: str, tpu_topology: str, title: str | None = None,
                   base_image: str = DEFAULT_BASE_IMAGE) -> JobSpec:
  """The full job spec; raises ValueError for bad arguments."""
  if title is None and gin_files:
    title = "spec_decode/" + os.path.splitext(os.path.basename(gin_files[-1]))[0]
  return JobSpec(experiment_title=title or "spec_decode",
                 container=container_spec(base_image=base_image),
                 requirements=TpuRequirements(tpu_type=tpu_type, topology=tpu_topology),
                 args=main_args(gin_files=gin_files, gin_bindings=gin_bindings,
                                output_dir=output_dir))


def launch(spec: JobSpec) -> None:
  """Builds the container and starts the job on Vertex AI (needs xmanager and GCP credentials)."""
  try:
    from xmanager import xm, xm_local
  except ImportError as e:
    raise SystemExit("launching needs XManager: pip install xmanager (or use --dry_run)") from e
  c, r = spec.container, spec.requirements
  with xm_local.create_experiment(experiment_title=spec.experiment_title) as experiment:
    [executable] = experiment.package([xm.Packageable(
        executable_spec=xm.PythonContainer(
            path=c.path, base_image=c.base_image,
            docker_instructions=list(c.docker_instructions),
            entrypoint=xm.CommandList(list(c.entrypoint))),
        executor_spec=xm_local.Vertex.Spec())])
    requirements = xm.JobRequirements({xm.ResourceType[r.resource]: r.cores})
    experiment.add(xm.Job(executable=executable,
                          executor=xm_local.Vertex(requirements=requirements),
                          args=list(spec.args)))


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The launcher's own flags; --gin_file, --gin_bindings, --output_dir are spec_decode.main's."""
  flags.DEFINE_enum("tpu_type", "v3", sorted(TPU_TYPES), "Cloud TPU generation",
                    flag_values=flag_values)
  flags.DEFINE_string("tpu_topology", "2x2", "TPU chip grid, e.g. 2x2 (a v3-8)",
                      flag_values=flag_values)
  flags.DEFINE_string("title", None, "experiment title (default from the last gin file)",
                      flag_values=flag_values)
  flags.DEFINE_string("base_image", DEFAULT_BASE_IMAGE, "container base image",
                      flag_values=flag_values)
  flags.DEFINE_bool("dry_run", False, "print the job spec as JSON and exit",
                    flag_values=flag_values)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  try:
    spec = build_job_spec(gin_files=f.gin_file, gin_bindings=f.gin_bindings,
                          output_dir=f.output_dir, tpu_type=f.tpu_type,
                          tpu_topology=f.tpu_topology, title=f.title, base_image=f.base_image)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if f.dry_run:
    json.dump(spec.to_json(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return
  launch(spec)


if __name__ == "__main__":
  sys.path.insert(0, REPO_ROOT)
  from spec_decode.cli import gin as gin_layer
  from spec_decode.cli import main as experiment_command
  experiment_command.define_flags()  # --gin_file, --gin_bindings, --output_dir, ...
  define_flags()
  app.run(main, flags_parser=lambda argv: flags.FLAGS(gin_layer.rewrite_gin_args(argv)))
