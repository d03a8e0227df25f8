"""CLI: generate tokens for one prompt and print the generated ids on one line, space-separated.

    python -m k3deploy.runtime.generate --model DIR --backend torch|onnxruntime|tensorrt --prompt-ids 1,2,3 --max-tokens N
    python -m k3deploy.runtime.generate --model DIR --prompt "text"        # needs tiktoken.model in DIR (or the checkpoint)
    torchrun --nproc-per-node 2 -m k3deploy.runtime.generate --model DIR --backend torch --ep 2 --prompt-ids 1,2,3
        # tensor parallel: one process per TP rank (gloo on CPU, NCCL on GPU); rank 0 prints
    python -m k3deploy.runtime.generate --model DIR --backend torch --device cuda --prompt-ids 1,2,3
        # the torch backend on a GPU (Triton kernels; --ops kernels: in place, --ops reference: fp32 references)
    python -m k3deploy.runtime.generate --model DIR --prompt-ids 5,786,7,787,789,788,9 --image cat.png
        # images (docs/VISION.md): --prompt-ids hold one <|media_pad|> per --image, --prompt one
        # <|kimi_image_placeholder|> per --image
"""
from __future__ import annotations

import argparse
import logging
import sys

from k3deploy.runtime.api import LLM, SamplingParams
from k3deploy.runtime.distributed import init_from_env, shutdown


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    try:
        return _main(argv, prog)
    finally:
        shutdown()


def _main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from k3deploy.model.layers import DENSE_DTYPES, dense_dtype_name
    ap = argparse.ArgumentParser(prog=prog or "python -m k3deploy.runtime.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint, ONNX export, engine or build output directory")
    ap.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"],
                    help="executor: torch (checkpoint), onnxruntime or tensorrt (export/engine dir; default: %(default)s)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--prompt", help="prompt text (needs a tokenizer: tiktoken.model)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all (default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    ap.add_argument("--max-context", type=int, default=None,
                    help="tokens per request the cache holds (default: the config's max_position_embeddings; "
                         "tensorrt: the engines')")
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism under torchrun: 1 or the world size (torch backend)")
    ap.add_argument("--device", default=None,
                    help="cpu (default), cuda (= cuda:LOCAL_RANK under torchrun) or cuda:N (torch backend; tensorrt: cuda:N)")
    ap.add_argument("--ops", default=None, choices=["reference", "torch", "kernels", "kernels-unfused"],
                    help="custom ops of the torch backend (default: reference on the CPU, torch = Triton kernels on CUDA; "
                         "kernels = the CUDA kernels in place with each layer's glue fused; kernels-unfused = the same "
                         "kernels in the reference's layer code)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay the decode step from CUDA graphs (torch backend, CUDA, --ops kernels; size them with "
                         "--max-context)")
    ap.add_argument("--dense-dtype", default=None, choices=list(DENSE_DTYPES), type=dense_dtype_name,
                    help="dense weights and their GEMMs of the torch backend: float32 (fp32) or bfloat16 (bf16) "
                         "(default float32, the reference precision; bfloat16 halves their bytes)")
    ap.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"],
                    help="torch.distributed backend under torchrun (default: nccl with a CUDA device, else gloo; "
                         "gloo with --device cuda:0 runs several ranks on one GPU, for tests)")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image for the prompt (repeatable, in prompt order; models with a vision tower): "
                         "--prompt-ids hold one <|media_pad|> id per image, --prompt one <|kimi_image_placeholder|>")
    ap.add_argument("--text", action="store_true", help="also print the decoded text on a second line")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if a.prompt_ids is not None:
            try:
                ids = [int(x) for x in a.prompt_ids.replace(" ", "").split(",") if x != ""]
            except ValueError:
                ap.error(f"--prompt-ids {a.prompt_ids!r}: expected comma-separated integers")
        rank, world = init_from_env(a.device if a.backend == "torch" else None, a.dist_backend)
        if a.ep > 1 and world == 1:
            ap.error(f"--ep {a.ep}: expert parallelism needs one process per rank: run under "
                     f"torchrun --standalone --nproc-per-node {a.ep} -m k3deploy.runtime.generate ...")
        llm = LLM(a.model, backend=a.backend, max_batch=None if a.backend == "tensorrt" else 1,
                  max_context=a.max_context, ep=a.ep, device=a.device,
                  ops=a.ops, cuda_graphs=a.cuda_graphs, dense_dtype=a.dense_dtype)
        if a.prompt is not None:
            if llm.tokenizer is None:
                ap.error(f"--prompt: no tokenizer (tiktoken.model) in {a.model}; use --prompt-ids")
            ids = llm.tokenizer.encode(a.prompt)
        images = None
        if a.image:
            ids, images = (llm.build_prompt(a.prompt, a.image) if a.prompt is not None
                           else llm.prepare_images(ids, a.image))
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                seed=a.seed, ignore_eos=a.ignore_eos)
        try:
            out = llm.generate([ids], params, images=None if images is None else [images])[0]
        finally:
            llm.executor.close()                            # CUDA graphs go before the process group
    except (ValueError, FileNotFoundError, ImportError, NotImplementedError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank != 0:
        return 0
    print(" ".join(str(t) for t in out.token_ids))
    if a.text and llm.tokenizer is None:
        print("warning: --text: no tokenizer (tiktoken.model) in the model directory; printing token ids only",
              file=sys.stderr)
    if a.text and llm.tokenizer is not None:
        try:
            print(llm.tokenizer.decode(out.token_ids))
        except ValueError as e:  # a model vocabulary larger than the tokenizer's
            print(f"error: --text: {e}", file=sys.stderr)
            return 1
    return 0 if out.finish_reason != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
