"""The `ifb` command line: run's grouped --help, vLLM aliases, --version, logging, the chat
template, engine-folder checks, API key sources, the server wiring (without a socket) and serve's
(without deploying)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from click.testing import CliRunner
from fastapi.testclient import TestClient

from ifb import __version__
from ifb.cli.logging_setup import JsonFormatter, configure_logging
from ifb.cli.main import cli
from ifb.cli.run_command import RUN_OPTION_GROUPS, run, set_compute_threads
from ifb.cli.serving_options import resolve_api_key
from ifb.runtime.llm import LLM
from ifb.runtime.reasoning import ReasoningParserKind
from ifb.runtime.server.tool_parsers import ToolCallParserKind

MARKER_TEMPLATE = "{% for m in messages %}MARKER {{ m['content'] }} {% endfor %}"
HI = [{"role": "user", "content": "hi"}]


pytestmark = pytest.mark.usefixtures("restore_root_logger")  # the CLI configures the root logger


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(cli, list(args), env=env)


# -- help, version, aliases -----------------------------------------------------------------------
def test_run_help_lists_flags_under_group_headings() -> None:
    """Each heading appears in order, with its own flags under it, and the vLLM aliases shown."""
    result = invoke("run", "--help")
    assert result.exit_code == 0, result.output
    text = result.output
    headings = ["Model:", "Limits:", "Scheduling:", "Server:", "Logging:"]
    positions = [text.index(heading) for heading in headings]
    assert positions == sorted(positions)
    assert positions[0] < text.index("--dtype") < positions[1] < text.index("--max-batch-size, --max-num-seqs")
    assert positions[2] < text.index("--enable-prefix-caching") < positions[3] < text.index("--api-key-file")
    assert positions[4] < text.index("--log-format")
    for alias in ("--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching"):
        assert f"vLLM's {alias}" in " ".join(text.split())  # help text wraps; compare word by word
    assert "visible to every user in `ps`" in " ".join(text.split()).lower()


def test_every_run_option_is_filed_under_a_heading() -> None:
    """Only --help falls through to "Other options": a new flag must be given a group."""
    grouped = {name for names in RUN_OPTION_GROUPS.values() for name in names}
    options = {p.name for p in run.params if isinstance(p, click.Option)}
    assert options - grouped == {"help"} or options - grouped == set()
    assert grouped <= options  # no stale names in the mapping


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output == f"ifb, version {__version__}\n"


def test_vllm_alias_names_parse_to_the_same_parameters() -> None:
    ours = ["--max-batch-size", "4", "--max-num-tokens", "32", "--no-enable-prefix-reuse"]
    vllm = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--no-enable-prefix-caching"]
    params_ours = run.make_context("run", ours).params
    params_vllm = run.make_context("run", vllm).params
    assert params_ours == params_vllm
    assert (params_vllm["max_batch_size"], params_vllm["max_num_tokens"]) == (4, 32)
    assert params_vllm["enable_prefix_reuse"] is False
    assert run.make_context("run", ["--enable-prefix-caching"]).params["enable_prefix_reuse"] is True


# -- logging --------------------------------------------------------------------------------------
def test_json_formatter_writes_one_parseable_line_with_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("ifb.test").makeRecord(
            "ifb.test", logging.ERROR, __file__, 1, "two\nlines %d", (7,), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert {k: entry[k] for k in ("level", "logger", "message")} == {
        "level": "ERROR",
        "logger": "ifb.test",
        "message": "two\nlines 7",
    }
    assert entry["time"].endswith("+00:00")
    assert "ValueError: boom" in entry["exc_info"]


def test_configure_logging_replaces_its_own_handler_only(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("warning", "text")
    configure_logging("debug", "json")
    logging.getLogger("ifb.test").debug("hello %s", "there")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(e["level"], e["message"]) for e in lines] == [("DEBUG", "hello there")]


@pytest.mark.parametrize(
    ("engine_fixture", "kv_dtype"), [("tiny_llama_engine", "float32"), ("tiny_llama_kv16_engine", "float16")]
)
def test_run_log_format_json_emits_json_lines(
    engine_fixture: str, kv_dtype: str, request: pytest.FixtureRequest
) -> None:
    """The startup line names the KV cache's dtype (an opt-in fp16 pool is visible in the log)."""
    engine = request.getfixturevalue(engine_fixture)
    result = invoke("run", str(engine), "--log-format", "json", "--prompt", "hi", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    entries = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    loaded = [e for e in entries if e["logger"] == "ifb.cli.run_command"]
    assert loaded and loaded[0]["level"] == "INFO" and "max_seq_len 256" in loaded[0]["message"]
    assert f"(float32, KV cache {kv_dtype}," in loaded[0]["message"]
    assert all(set(e) >= {"time", "level", "logger", "message"} for e in entries)


@pytest.mark.parametrize(
    ("args", "level"),
    [
        (["-v", "run"], logging.DEBUG),
        (["-v", "run", "--log-level", "warning"], logging.WARNING),
        (["run"], logging.INFO),
    ],
)
def test_verbose_means_debug_unless_run_names_a_level(tiny_llama_engine: Path, args: list[str], level: int) -> None:
    """The refused --dtype stops `run` right after it configured logging, before any engine loads."""
    result = invoke(*args, str(tiny_llama_engine), "--dtype", "bf16")
    assert result.exit_code == 1
    assert logging.getLogger().level == level


# -- model flags ----------------------------------------------------------------------------------
def test_chat_template_file_changes_the_prompt_run_sends(
    tiny_llama_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--prompt` renders the user's message with --chat-template's file, not the tokenizer's."""
    template = tmp_path / "template.jinja"
    template.write_text(MARKER_TEMPLATE)
    with LLM(tiny_llama_engine) as default, LLM(tiny_llama_engine, chat_template=MARKER_TEMPLATE) as custom:
        default_ids, marker_ids = default.apply_chat_template(HI), custom.apply_chat_template(HI)
    assert marker_ids != default_ids
    sent: list[Any] = []
    original = LLM.stream

    def recording_stream(self: LLM, prompt: Any, params: Any = None) -> Any:
        sent.append(prompt)
        return original(self, prompt, params)

    monkeypatch.setattr(LLM, "stream", recording_stream)
    result = invoke(
        "run", str(tiny_llama_engine), "--chat-template", str(template), "--prompt", "hi", "--max-tokens", "2"
    )
    assert result.exit_code == 0, result.output
    result = invoke("run", str(tiny_llama_engine), "--prompt", "hi", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert sent == [marker_ids, default_ids]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--dtype", "bf16"], ["dtype float32, not bfloat16", "--dtype bfloat16"]),
        (["--max-model-len", "512"], ["--max-model-len 512 exceeds", "max_seq_len 256", "--max-seq-len 512"]),
        (["--max-model-len", "128"], ["--max-model-len 128 is below", "max_seq_len 256", "--max-seq-len 128"]),
    ],
)
def test_engine_folder_refuses_other_build_options_in_one_line(
    tiny_llama_engine: Path, flags: list[str], expected: list[str]
) -> None:
    result = invoke("run", str(tiny_llama_engine), *flags, "--prompt", "hi")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "rebuild with: ifb build " in line
    for text in expected:
        assert text in line


def test_engine_folder_accepts_its_own_dtype_and_max_model_len(tiny_llama_engine: Path) -> None:
    result = invoke(
        "run",
        str(tiny_llama_engine),
        "--dtype",
        "fp32",
        "--max-model-len",
        "256",
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
    )
    assert result.exit_code == 0, result.output


def test_set_compute_threads_sets_torch_and_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        set_compute_threads(1)
        assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == (1, "1")
    finally:
        torch.set_num_threads(before)
    set_compute_threads(None)
    assert torch.get_num_threads() == before


# -- API key --------------------------------------------------------------------------------------
def test_api_key_comes_from_the_flag_then_the_file_then_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {"IFB_API_KEY": "from-env"}
    assert resolve_api_key("from-flag", None, env) == "from-flag"
    assert resolve_api_key(None, key_file, env) == "from-file"
    assert resolve_api_key(None, None, env) == "from-env"
    assert resolve_api_key(None, None, {}) is None


def test_api_key_refuses_both_flags_and_empty_keys(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(click.UsageError, match="not both"):
        resolve_api_key("k", empty, {})
    with pytest.raises(click.ClickException, match="--api-key-file .* is empty"):
        resolve_api_key(None, empty, {})
    with pytest.raises(click.ClickException, match="IFB_API_KEY is empty"):
        resolve_api_key(None, None, {"IFB_API_KEY": ""})


def test_serve_wires_names_cors_key_and_log_level(tiny_llama_engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ifb run ENGINE` hands uvicorn an app with the served names, CORS origin and the key from
    IFB_API_KEY; uvicorn.run is replaced, so no socket is opened."""
    import uvicorn

    seen: dict[str, Any] = {}

    def fake_uvicorn_run(app: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        client = TestClient(app)
        seen["no_key"] = client.get("/v1/models").status_code
        models = client.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        seen["models"] = [card["id"] for card in models.json()["data"]]
        preflight = client.options(
            "/v1/models",
            headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "GET"},
        )
        seen["cors"] = preflight.headers.get("access-control-allow-origin")

    monkeypatch.setattr(uvicorn, "run", fake_uvicorn_run)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)  # keep the test process's
    result = invoke(
        "run",
        str(tiny_llama_engine),
        "--served-model-name",
        "alias-a",
        "--served-model-name",
        "alias-b",
        "--allowed-origins",
        "http://ui.example",
        "--log-level",
        "warning",
        env={"IFB_API_KEY": "sesame"},
    )
    assert result.exit_code == 0, result.output
    assert seen["no_key"] == 401
    assert seen["models"] == ["alias-a", "alias-b"]
    assert seen["cors"] == "http://ui.example"
    assert (seen["log_level"], seen["log_config"]) == ("warning", None)


def test_serve_builds_with_run_build_options_and_hands_every_setting_on(
    tiny_llama_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ifb serve SOURCE` builds with the flags' build options (not the defaults), and the replicas
    get the runtime settings, the Ray options and the server's keywords; nothing is deployed."""
    pytest.importorskip("ray.serve")
    import ifb.find_or_build
    import ifb.ray_serve.deploy

    seen: dict[str, Any] = {}

    def fake_find_or_build(target: Any, options: Any, engines_dir: Path) -> Path:
        seen["build"] = options
        return tiny_llama_engine

    def fake_serve_engine(engine: Path, settings: Any, options: Any, blocking: bool = True) -> None:
        seen.update(engine=engine, settings=settings, options=options)

    monkeypatch.setattr(ifb.find_or_build, "find_or_build_engine", fake_find_or_build)
    monkeypatch.setattr(ifb.ray_serve.deploy, "serve_engine", fake_serve_engine)
    monkeypatch.setattr(ifb.ray_serve.deploy, "shutdown", lambda: None)
    template = tmp_path / "template.jinja"
    template.write_text(MARKER_TEMPLATE)
    result = invoke(
        "serve",
        str(tmp_path / "some-source"),
        "--replicas",
        "3",
        "--threads",
        "2",
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "512",
        "--calibrate",
        "--chat-template",
        str(template),
        "--served-model-name",
        "alias-a",
        "--port",
        "9001",
        "--log-format",
        "json",
        "--reasoning-parser",
        "deepseek_r1",
        "--tool-call-parser",
        "mistral",
        env={"IFB_API_KEY": "sesame"},
    )
    assert result.exit_code == 0, result.output
    build = seen["build"]
    assert (build.max_batch_size, build.max_num_tokens, build.max_seq_len) == (32, 512, 512)
    assert seen["engine"] == tiny_llama_engine.resolve()
    settings, options = seen["settings"], seen["options"]
    assert (settings.max_batch_size, settings.calibrate, settings.chat_template) == (32, True, MARKER_TEMPLATE)
    assert (options.num_replicas, options.threads_per_replica, options.port) == (3, 2, 9001)
    assert options.app_options == {
        "served_model_names": ("alias-a",),
        "api_key": "sesame",
        "allowed_origins": (),
        "reasoning_parser": ReasoningParserKind.DEEPSEEK_R1,
        "tool_call_parser": ToolCallParserKind.MISTRAL,
    }
