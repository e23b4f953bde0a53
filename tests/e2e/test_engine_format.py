"""engine.json checks at load: version, missing or corrupted files; build refusals; CLI errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import GPT2Config

from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import SourceError, UnsupportedModelError
from ifb.cli.main import cli
from ifb.runtime.engine_format import ENGINE_FORMAT_VERSION, RECORD_SHA256, EngineConfig, record_sha256
from ifb.runtime.errors import EngineFormatError, LimitExceededError
from ifb.runtime.llm import LLM
from ifb.runtime.step.engine import Engine


@pytest.fixture()
def engine_copy(tiny_llama_engine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_engine, tmp_path / "engine"))


def test_engine_json_records_limits_and_hashes(tiny_llama_engine: Path) -> None:
    record = json.loads((tiny_llama_engine / "engine.json").read_text())
    assert record["limits"] == {
        "max_batch_size": 8,
        "max_num_tokens": 64,
        "max_seq_len": 256,
        "block_size": 16,
        "num_kv_blocks": 48,
    }
    assert (
        record["backend"] == "cpu"
        and record["dtype"] == "float32"
        and record["format_version"] == ENGINE_FORMAT_VERSION
    )
    assert {"step.pt2", "weights.safetensors", "tokenizer/tokenizer.json"} <= set(record["artifacts"])
    assert len(record["source"]["sha256"]) == 64 and record["tokenizer"]["has_chat_template"]


def test_corrupted_artifact_is_refused(engine_copy: Path) -> None:
    with (engine_copy / "weights.safetensors").open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\x01\x02")
    with pytest.raises(EngineFormatError, match="weights.safetensors.*corrupted"):
        Engine.load(engine_copy)


def test_missing_artifact_is_refused(engine_copy: Path) -> None:
    (engine_copy / "step.pt2").unlink()
    with pytest.raises(EngineFormatError, match="step.pt2.*missing"):
        Engine.load(engine_copy)


def test_wrong_format_version_is_refused(engine_copy: Path) -> None:
    path = engine_copy / "engine.json"
    record = json.loads(path.read_text())
    record["format_version"] = 99
    path.write_text(json.dumps(record))
    with pytest.raises(EngineFormatError, match="format_version 99"):
        Engine.load(engine_copy)


def test_engine_json_round_trips_through_the_typed_record(tiny_llama_engine: Path) -> None:
    config = EngineConfig.load(tiny_llama_engine)
    assert EngineConfig.from_json(config.to_json(), config.folder) == config
    assert json.loads((tiny_llama_engine / "engine.json").read_text()) == json.loads(json.dumps(config.to_json()))


@pytest.mark.parametrize("field", ["step_package", "weights"])
def test_paths_outside_the_engine_folder_are_refused(engine_copy: Path, field: str) -> None:
    path = engine_copy / "engine.json"
    record = json.loads(path.read_text())
    record[field] = "../../etc/passwd"
    path.write_text(json.dumps(record))
    with pytest.raises(EngineFormatError, match=f"{field}.*outside the engine folder"):
        EngineConfig.load(engine_copy, verify=False)


def test_missing_field_is_named(engine_copy: Path) -> None:
    path = engine_copy / "engine.json"
    record = json.loads(path.read_text())
    del record["limits"]
    path.write_text(json.dumps(record))
    with pytest.raises(EngineFormatError, match="missing field 'limits'"):
        EngineConfig.load(engine_copy)


def test_rebuild_hint_is_a_command_the_real_cli_accepts(tiny_llama_engine: Path) -> None:
    """The printed command, pasted into `ifb build`'s own parser, reproduces every build option."""
    import shlex

    from ifb.cli.build_command import build

    config = EngineConfig.load(tiny_llama_engine)
    words = shlex.split(config.rebuild_command(max_batch_size=16))
    assert words[:2] == ["ifb", "build"]
    context = build.make_context("build", words[2:])
    params = context.params
    assert params["max_batch_size"] == 16 and params["output"] == tiny_llama_engine.resolve()
    options = config.build_options
    for name in ("max_num_tokens", "max_seq_len", "block_size", "dtype", "backend", "weights", "kv_dtype"):
        assert str(params[name]) == str(getattr(options, name)), name
    assert params["kv_blocks"] == options.kv_blocks and params["source"] == config.source.path


def test_runtime_may_lower_but_never_raise_a_limit(tiny_llama_engine: Path) -> None:
    with pytest.raises(LimitExceededError) as error:
        LLM(tiny_llama_engine, max_batch_size=16)
    message = str(error.value)
    assert (
        "max_batch_size 16" in message
        and "max_batch_size=8" in message
        and "ifb build" in message
        and "--max-batch-size 16" in message
    )
    with LLM(tiny_llama_engine, max_batch_size=2, max_num_tokens=32) as llm:
        assert (llm.config.max_batch_size, llm.config.max_num_tokens) == (2, 32)


def test_unsupported_architecture_fails_the_build(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="supported model types"):
        build_engine(folder, tmp_path / "out", BuildOptions())
    assert not (tmp_path / "out").exists()


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        build_engine(tmp_path / "nope", tmp_path / "out", BuildOptions())


def test_cli_build_reports_errors_without_traceback(tmp_path: Path, tiny_llama_dir: Path) -> None:
    result = CliRunner().invoke(cli, ["build", str(tiny_llama_dir), "--max-seq-len", "4096", "-o", str(tmp_path / "x")])
    assert result.exit_code == 1
    assert "max_seq_len 4096" in result.output and "Traceback" not in result.output


def test_tensorrt_without_cuda_is_one_clear_line(tiny_llama_dir: Path, engine_copy: Path, tmp_path: Path) -> None:
    """No CUDA here: building or running a TensorRT engine refuses without a traceback."""
    runner = CliRunner()
    built = runner.invoke(cli, ["build", str(tiny_llama_dir), "--backend", "tensorrt", "-o", str(tmp_path / "trt")])
    assert built.exit_code == 1 and "CUDA GPU" in built.output and "[tensorrt]" in built.output
    assert "Traceback" not in built.output and not (tmp_path / "trt").exists()
    record = json.loads((engine_copy / "engine.json").read_text())
    record["backend"] = "tensorrt"
    record[RECORD_SHA256] = record_sha256(record)  # sealed, as a TensorRT build's record is
    (engine_copy / "engine.json").write_text(json.dumps(record))
    ran = runner.invoke(cli, ["run", str(engine_copy), "--prompt", "hi"])
    assert ran.exit_code == 1 and "CUDA GPU" in ran.output and "Traceback" not in ran.output


def test_fp16_is_refused_by_the_cpu_backend_naming_the_backend(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["build", str(tiny_llama_dir), "--dtype", "fp16", "-o", str(tmp_path / "x")])
    assert result.exit_code == 1 and "'fp16'" in result.output and "cpu backend" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "x").exists()


def test_the_cpu_path_never_imports_tensorrt_or_onnx(tiny_llama_engine: Path) -> None:
    """Serving a CPU engine end to end (server app, LLM, a generated answer) loads neither."""
    script = (
        "import sys\n"
        "from ifb.runtime.server import create_app\n"
        "from ifb.runtime.llm import LLM\n"
        "from ifb import SamplingParams\n"
        f"llm = LLM({str(tiny_llama_engine)!r})\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))\n"
        "assert len(out[0].token_ids) == 3\n"
        "create_app(llm)\n"
        "llm.close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'onnx', 'onnxruntime', 'cuda')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
