"""k3deploy: Kimi K3 from a checkpoint to a verified TensorRT / Triton deployment.

Parts (each a subpackage, one folder of the repository): `k3deploy.model` (config, fp32 reference, checkpoint
I/O, synthetic checkpoints, sharding), `k3deploy.plugins` (the `kimi` custom ops: references, torch ops, ONNX
nodes, TensorRT plugins, GPU kernels), `k3deploy.export` (per-layer ONNX, verification, the build pipeline),
`k3deploy.engines` (TensorRT builds, manifest), `k3deploy.runtime` (tokenizer, cache, scheduler, executors, API),
`k3deploy.serve` (Triton repository, model and launcher). The command line is `k3deploy` (`k3deploy --help`).
"""

__version__ = "0.1.0"

# In a source checkout the parts are this folder's siblings (model/, runtime/, ...): the installed package maps
# them the same way (pyproject.toml's package-dir), and this line lets the checkout import them with only its root
# on sys.path (PYTHONPATH=., a Triton stub given `project_root`).
import pathlib as _pathlib

_ROOT = _pathlib.Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "runtime" / "api.py").is_file() and str(_ROOT) not in __path__:
    __path__.append(str(_ROOT))
del _pathlib
