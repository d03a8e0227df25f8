"""Serving k3deploy models with Triton Inference Server.

* :mod:`serve.launch` – start the ``tritonserver`` bundled in ``nvidia-pytriton`` on loopback ports (and the front).
* :mod:`serve.repository` – write a Triton model repository (decoupled Python-backend models ``k3`` and ``k3_text``).
* :mod:`serve.model` – the ``TritonPythonModel`` copied to ``REPO/k3/1/model.py``; drives ``runtime.api``.
* :mod:`serve.text_model` – ``REPO/k3_text/1/model.py``: text in, text out (TensorRT-LLM's ensemble names).
* :mod:`serve.openai` – the OpenAI-compatible HTTP front over the ``k3`` model's gRPC stream.
"""
