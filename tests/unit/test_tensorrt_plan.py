"""TensorRT plans are tied to a TensorRT version and a GPU: the load-time check, without a GPU."""

from __future__ import annotations

import dataclasses

from ifb.runtime.engine_format import TensorRTPlanInfo
from ifb.runtime.step.tensorrt_step import plan_mismatch

BUILT_ON = TensorRTPlanInfo(version="10.9.0", gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def test_the_same_machine_matches() -> None:
    assert plan_mismatch(BUILT_ON, dataclasses.replace(BUILT_ON)) is None


def test_another_tensorrt_version_is_named_with_both_values() -> None:
    message = plan_mismatch(BUILT_ON, dataclasses.replace(BUILT_ON, version="10.12.0"))
    assert message is not None and "TensorRT version" in message and "10.9.0" in message and "10.12.0" in message


def test_another_gpu_is_named() -> None:
    message = plan_mismatch(BUILT_ON, dataclasses.replace(BUILT_ON, gpu_name="NVIDIA L4", compute_capability="8.9"))
    assert message is not None and "NVIDIA L4" in message and "H100" in message


def test_a_plan_without_a_record_does_not_match() -> None:
    assert plan_mismatch(None, BUILT_ON) is not None
