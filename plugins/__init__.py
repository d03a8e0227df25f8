try:  # TensorRT plugin registration; plugins.trt_common imports without TensorRT (it only needs it when called)
    from k3deploy.plugins.trt_common import register_tensorrt_plugins  # noqa: F401
except ImportError:  # pragma: no cover - never let the package import fail because of the TensorRT part
    pass
