"""The TensorRT engine on a CUDA GPU: vs the torch reference, vs the CPU engine, behind the server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from greedy_loop import greedy_generate
from server_harness import running_server
from step_cases import prompts, run_mixed_step

from ifb.runtime.engine_format import RECORD_SHA256, record_sha256
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.llm import LLM
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

GPU_FP32_TOLERANCE = 1e-3  # fp32 with TF32 off; GPU reduction order differs from the CPU's


def test_engine_json_records_the_plan_and_the_gpu(tiny_llama_trt_fp32: Path) -> None:
    record = json.loads((tiny_llama_trt_fp32 / "engine.json").read_text())
    assert record["backend"] == "tensorrt" and record["step_package"] == "step.plan"
    assert set(record["tensorrt"]) == {"version", "gpu_name", "compute_capability"}
    assert record["tensorrt"]["gpu_name"] == torch.cuda.get_device_name()


def test_tensorrt_step_matches_the_torch_reference_on_a_mixed_step(tiny_llama_trt_fp32: Path) -> None:
    reference = Engine.load(tiny_llama_trt_fp32, StepMode.REFERENCE)  # our network, CPU, same weights
    on_gpu = Engine.load(tiny_llama_trt_fp32, StepMode.COMPILED)
    assert on_gpu.kv_cache.is_cuda
    expected, actual = run_mixed_step(reference), run_mixed_step(on_gpu)
    assert actual.shape == expected.shape and not actual.is_cuda
    assert (actual - expected).abs().max().item() < GPU_FP32_TOLERANCE
    assert (on_gpu.kv_cache.cpu() - reference.kv_cache).abs().max().item() < GPU_FP32_TOLERANCE


def test_greedy_equals_the_cpu_engine(tiny_llama_trt_fp32: Path, tiny_llama_engine: Path) -> None:
    on_gpu = Engine.load(tiny_llama_trt_fp32)
    on_cpu = Engine.load(tiny_llama_engine)
    for prompt in prompts(on_cpu.config.spec.vocab_size, [5, 23, 40], seed=7):
        assert greedy_generate(on_gpu, prompt, 24, chunk=16) == greedy_generate(on_cpu, prompt, 24, chunk=16)


def test_bf16_plan_serves_batched_requests(tiny_llama_trt_bf16: Path) -> None:
    with LLM(tiny_llama_trt_bf16) as llm:
        outputs = llm.generate([[5, 6, 7], list(range(3, 60))], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [12, 12]


def test_a_plan_built_for_another_gpu_is_refused_with_the_rebuild_command(
    tiny_llama_trt_fp32: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(tiny_llama_trt_fp32, tmp_path / "engine"))
    record = json.loads((copy / "engine.json").read_text())
    record["tensorrt"]["gpu_name"] = "Some Other GPU"
    record[RECORD_SHA256] = record_sha256(record)  # sealed, as that GPU's build would have
    (copy / "engine.json").write_text(json.dumps(record))
    with pytest.raises(EngineFormatError, match="Some Other GPU.*ifb build .*--backend tensorrt"):
        Engine.load(copy)


def test_server_smoke(tiny_llama_trt_fp32: Path) -> None:
    """The same server over the GPU engine: a streamed and a plain completion agree; nothing leaks."""
    with LLM(tiny_llama_trt_fp32) as llm, running_server(llm) as base:
        body = {"model": llm.model_name, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
        plain = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        chunks = []
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert plain["choices"][0]["text"] == "".join(chunks) and plain["usage"]["completion_tokens"] == 8
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["scheduling"]["resident"] == 0 and health["scheduling"]["completed"] == 2
