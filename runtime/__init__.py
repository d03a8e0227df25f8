"""k3deploy runtime: hybrid decode-state cache, continuous-batching scheduler, layer-by-layer executors
(torch / onnxruntime / tensorrt), the `LLM` API and the tokenizer. Imports `model/` and `plugins/` only."""
