"""Serving k3deploy models with Triton Inference Server.

* :mod:`serve.launch` – start the ``tritonserver`` bundled in ``nvidia-pytriton`` on loopback ports.
* :mod:`serve.repository` – write a Triton model repository (decoupled Python-backend model ``k3``).
* :mod:`serve.model` – the ``TritonPythonModel`` copied to ``REPO/k3/1/model.py``; drives ``runtime.api``.
"""
