"""What this machine offers the TensorRT backend: whether it can run at all, and which GPU and
TensorRT version a plan built here is tied to. Never imports tensorrt unless asked for the GPU."""

from __future__ import annotations

import importlib.util

import torch

from ifb.runtime.engine_format import TensorRTPlanInfo

TENSORRT_UNAVAILABLE = (
    "the tensorrt backend needs a CUDA GPU and the [tensorrt] extra (pip install -e '.[tensorrt]'); "
    "this ifb builds and runs --backend cpu engines"
)


def tensorrt_unavailable_reason() -> str | None:
    """None where a CUDA device and the tensorrt module are both present, else the message."""
    if importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available():
        return TENSORRT_UNAVAILABLE
    return None


def this_gpu() -> TensorRTPlanInfo:
    """What a plan is tied to: the TensorRT version and the GPU it was built on."""
    import tensorrt as trt

    major, minor = torch.cuda.get_device_capability()
    return TensorRTPlanInfo(trt.__version__, torch.cuda.get_device_name(), f"{major}.{minor}")
