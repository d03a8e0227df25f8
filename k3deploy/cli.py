"""The `k3deploy` command: one subcommand per job, each the CLI of the module named below (same options).

    k3deploy build      the main job: checkpoint -> ONNX -> verification -> engines -> Triton repository -> smoke
    k3deploy plan       the deployment plan only (= build --dry-run; allocates no weights)
    k3deploy export     per-layer ONNX export
    k3deploy verify     Polygraphy: ONNX Runtime vs the PyTorch reference
    k3deploy engines    TensorRT / TensorRT-RTX engine builds from an export
    k3deploy repository write a Triton model repository
    k3deploy serve      run tritonserver on a repository (--openai-port: with the OpenAI-compatible front)
    k3deploy openai     run the OpenAI-compatible front for a running tritonserver
    k3deploy generate   generate tokens with the runtime
    k3deploy synthetic  write a synthetic checkpoint of a preset
    k3deploy params     parameter and byte counts of a preset, config or checkpoint
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

# subcommand -> (module with main(argv, prog), one-line summary, arguments put before the user's)
COMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "build": ("k3deploy.export.build_engines", "checkpoint -> verified deployment (ONNX, engines, Triton repo)", ()),
    "plan": ("k3deploy.export.build_engines", "print the deployment plan only (build --dry-run)", ("--dry-run",)),
    "export": ("k3deploy.export.onnx_export", "per-layer ONNX export of a checkpoint", ()),
    "verify": ("k3deploy.export.verify", "compare an ONNX export with the PyTorch reference (Polygraphy)", ()),
    "engines": ("k3deploy.engines.build", "build TensorRT / TensorRT-RTX engines from an ONNX export", ()),
    "repository": ("k3deploy.serve.repository", "write a Triton model repository", ()),
    "serve": ("k3deploy.serve.launch", "run tritonserver on a model repository (and the OpenAI front)", ()),
    "openai": ("k3deploy.serve.openai", "OpenAI-compatible HTTP front for a running tritonserver", ()),
    "generate": ("k3deploy.runtime.generate", "generate tokens with the runtime (torch / onnxruntime / tensorrt)", ()),
    "synthetic": ("k3deploy.model.synthetic", "write a synthetic checkpoint of a preset", ()),
    "params": ("k3deploy.model.params", "parameter and byte counts of a preset, config.json or checkpoint", ()),
}


def usage() -> str:
    """The top-level help text: one line per subcommand."""
    w = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{w}}  {summary}" for name, (_, summary, _) in COMMANDS.items())
    return (f"usage: k3deploy <command> [options]\n\ncommands:\n{rows}\n\n"
            "`k3deploy <command> --help` shows a command's options.")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the subcommand's `main`; returns its exit status (2 for an unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from k3deploy import __version__
        print(f"k3deploy {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"k3deploy: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, pre = COMMANDS[name]
    mod = importlib.import_module(module)
    try:
        return int(mod.main([*pre, *rest], prog=f"k3deploy {name}") or 0)
    except SystemExit as e:          # argparse's --help / usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
