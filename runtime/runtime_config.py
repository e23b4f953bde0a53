"""What a user asks of the runtime (RuntimeSettings), its HTTP server (ServerSettings) and its
replicas on Ray Serve (ServeOptions), each option declared once with its default, help and lower
bound; RuntimeConfig: the runtime settings checked against the engine's baked limits."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.guided_pool import COMPILE_TIMEOUT_S
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind
from ifb.runtime.prefix_disk_tier import BYTES_PER_GB, PrefixDiskTierConfig
from ifb.runtime.reasoning import ReasoningParserKind
from ifb.runtime.server.tool_parsers import ToolCallParserKind
from ifb.runtime.speculation.config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DEFAULT_SUFFIX_CACHE_TOKENS,
    SpeculativeConfig,
    SpeculativeMethod,
    parse_speculative_config,
)
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step_budget.budgets import DEFAULT_TARGET_DECODE_MULTIPLE, DEFAULT_TARGET_FLOOR_MS

DEFAULT_PREFIX_CACHE_DISK_GB = 10.0


def option(default: Any, help: str | None = None, **cli: Any) -> Any:
    """A settings field carrying what every front end (ifb build/run/serve/bench, LLM(...)) reads off
    it: `help`, and in `cli` the hints cli/field_options.py turns into a click option -- `minimum`
    (also checked here), `flag` (instead of --field-name), `aliases`, `choices`, `case_sensitive`,
    `exists` (a Path that must exist), and `cli=False` for a field no flag sets."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """What a user asks of the runtime (`ifb run` / `ifb serve` flags, `LLM(...)` keywords),
    defined once and passed whole; None means the engine's baked value."""

    max_batch_size: int | None = option(
        None, "Seats per step (<= the engine's). Alias: vLLM's --max-num-seqs.", minimum=1, aliases=("--max-num-seqs",)
    )
    max_num_tokens: int | None = option(
        None,
        "Tokens per step (<= the engine's). Alias: vLLM's --max-num-batched-tokens.",
        minimum=1,
        aliases=("--max-num-batched-tokens",),
    )
    max_queued_requests: int = option(64, "Requests that may wait for a seat; beyond them a 429.", minimum=0)
    # The executor refuses what waited longer, so `ifb run`, each `ifb serve` replica and LLM(...)
    # enforce it alike; the server turns the refusal into a 429.
    queue_timeout: float | None = option(
        None, "Seconds a request may wait for its first admission before it is refused (a 429).", minimum=0
    )
    guided_compile_timeout: float = option(
        COMPILE_TIMEOUT_S,
        "Seconds a guided request's constraint may take to compile (from when a warm compile worker "
        "takes it; waiting for one is not counted); past it the request is refused (a 400).",
        minimum=0,
    )
    policy: CapacityPolicyKind = option(
        CapacityPolicyKind.GUARANTEED_NO_EVICT,
        "Who may hold KV blocks: guaranteed_no_evict admits only what fits to completion; max_utilization "
        "admits what fits now and preempts when short; static_batch admits only when nothing runs.",
    )
    chunking: ChunkingPolicyKind = option(
        ChunkingPolicyKind.FIRST_COME_FIRST_SERVED,
        "Who gets a step's prefill budget: fcfs the oldest prompt first, equal_progress a share each.",
    )
    enable_prefix_reuse: bool = option(
        True,
        "Reuse the KV blocks of a shared prompt prefix. Alias: vLLM's --enable-prefix-caching.",
        aliases=("--enable-prefix-caching",),
    )
    prefix_cache_dir: str | None = option(
        None,
        "Keep prefix-cache blocks evicted from RAM in files under DIR (created if missing), and bring them "
        "back when a prompt's prefix needs them, also after a restart: a long shared prompt skips its "
        "prefill. Files are keyed by the prefix hash (cache_salt included) and the engine's build id, "
        "and checksummed; RAM's cached blocks are written at shutdown too.",
    )
    prefix_cache_disk_gb: float | None = option(
        None,
        f"GB (10^9 bytes) the --prefix-cache-dir files may take; the least recently used go first. Default: "
        f"{DEFAULT_PREFIX_CACHE_DISK_GB:g}.",
        minimum=0,
    )
    # A request without max_tokens generates at most this many tokens (and never past
    # max_seq_len), so guaranteed_no_evict reserves a bounded number of blocks for it instead of
    # a whole max_seq_len -- one such request can no longer serialize the server.
    default_max_tokens: int = option(512, "For requests without max_tokens.", minimum=1)
    kv_blocks: int | None = option(
        None, "KV blocks the scheduler may use (<= the engine's pool).", minimum=1, cli=False
    )
    step_mode: StepMode = option(StepMode.COMPILED, "compiled, or an eager path for checking it.", cli=False)
    # `ifb run --chat-template FILE` reads the file into it.
    chat_template: str | None = option(None, "A Jinja template replacing the tokenizer's own.", cli=False)
    itl_target_ms: float | None = option(
        None,
        "Inter-token latency target: each step's prefill chunk is the largest whose predicted step time "
        "(the engine's cost model) stays under it, and at least one block, so streams never stall behind a "
        f"long prompt. Default: {DEFAULT_TARGET_DECODE_MULTIPLE:g}x each step's own predicted decode time, at "
        f"least {DEFAULT_TARGET_FLOOR_MS:g} ms, so the worst gap stays a small multiple of the typical one at any "
        "load (/health shows it); off for an engine without a cost model. 0 = off: every step may take "
        "--max-num-tokens.",
        minimum=0,
    )
    ttft_target_ms: float | None = option(
        None,
        "Time-to-first-token target: when prompts waiting for their first token near it, a step's prefill "
        "chunk grows past the inter-token target (up to 1.2x it) as far as their deadlines need, so requests "
        "meet both targets. Default: derived from the cost model (the time to prefill a full batch of "
        "256-token prompts alone, at least 1 s; /health shows it). 0 = off. Needs an inter-token target: a "
        "value with --itl-target-ms 0 is refused.",
        minimum=0,
    )
    calibrate: bool = option(
        False,
        "Re-measure the step cost model on this machine at start, before serving (seconds to minutes), instead "
        "of using engine.json's or the one this machine stored for the engine's shape; the new fit is stored. "
        "Without it, an engine with neither serves at once with a conservative step budget and is timed in "
        "the server's idle turns.",
    )
    trace: str | None = option(
        None,
        "Write a Chrome trace of the steps and requests to FILE when the engine closes (open it in Perfetto or "
        "chrome://tracing); each ifb serve replica writes its own, FILE's name with -REPLICA added.",
    )
    speculative: SpeculativeMethod = option(
        SpeculativeMethod.OFF,
        "Speculative decoding: ngram drafts a decoding request's next tokens from its own prompt and output "
        "(prompt lookup), suffix also from recent requests with the same cache_salt, draft from a second "
        "compiled engine with the same tokenizer (--draft-engine). Drafts are verified in "
        "the same step as every other request, as many as the step budget's cost model says pay off: a "
        "lone stream speculates, a full batch stops by itself. Output is what decoding without it gives.",
    )
    num_speculative_tokens: int = option(
        DEFAULT_NUM_SPECULATIVE_TOKENS, "Most draft tokens a request verifies in one step.", minimum=1
    )
    prompt_lookup_max: int = option(DEFAULT_PROMPT_LOOKUP_MAX, "Longest n-gram a draft is matched on.", minimum=1)
    prompt_lookup_min: int = option(DEFAULT_PROMPT_LOOKUP_MIN, "Shortest n-gram a draft is matched on.", minimum=1)
    suffix_cache_tokens: int = option(
        DEFAULT_SUFFIX_CACHE_TOKENS,
        "Tokens of recent requests the suffix method keeps (4 bytes each), over all cache_salts.",
        minimum=1,
    )
    draft_engine: str | None = option(
        None,
        "The draft method's engine folder (ifb build of a smaller model with the same tokenizer); its KV pool "
        "and limits are its own.",
    )
    speculative_config: str | None = option(
        None,
        'vLLM\'s form, a JSON object: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}; its keys override the flags above.',
    )

    def speculation(self) -> SpeculativeConfig:
        """The speculative settings as one config (vLLM's JSON, if given, over the flags)."""
        same_named = {f.name: getattr(self, f.name) for f in fields(SpeculativeConfig) if f.name != "method"}
        base = SpeculativeConfig(self.speculative, **same_named)
        return base if self.speculative_config is None else parse_speculative_config(self.speculative_config, base)

    def __post_init__(self) -> None:  # accept the enums' string values from CLIs and callers
        object.__setattr__(self, "speculative", SpeculativeMethod(self.speculative))
        object.__setattr__(self, "policy", CapacityPolicyKind(self.policy))
        object.__setattr__(self, "chunking", ChunkingPolicyKind(self.chunking))
        object.__setattr__(self, "step_mode", StepMode(self.step_mode))


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What a user asks of the OpenAI-compatible server (`ifb run`, `ifb serve`): where it listens,
    and create_app's keywords."""

    host: str = option("127.0.0.1", "Address to listen on.")
    port: int = option(8000, "Port to listen on.")
    served_model_names: tuple[str, ...] = option(
        (),
        "A model name clients may use (repeatable; the first is reported). Default: the engine's.",
        flag="--served-model-name",
    )
    api_key: str | None = option(None, "Require Authorization: Bearer KEY on /v1/*.", cli=False)  # cli: 3 sources
    allowed_origins: tuple[str, ...] = option((), "A CORS origin browsers may call from (repeatable; default none).")
    reasoning_parser: ReasoningParserKind | None = option(
        None,
        "Split chat replies' <think>...</think> part off as message.reasoning_content (delta.reasoning_content "
        "when streamed): qwen3 when the reply or the prompt opens the tag, deepseek_r1 always (its template "
        "opens it). Default: replies as generated.",
    )
    tool_call_parser: ToolCallParserKind | None = option(
        None,
        "The format tool calls are read in from chat replies (tool_choice auto): hermes "
        "(<tool_call>{...}</tool_call>: Qwen, SmolLM, Hermes), llama3_json (a reply that is "
        '{"name": ..., "parameters": ...}: Llama 3.x) or mistral ([TOOL_CALLS]...). Default: the one the '
        "chat template teaches (hermes if it shows none).",
    )

    def __post_init__(self) -> None:  # accept the enums' string values from CLIs and callers
        if self.reasoning_parser is not None:
            object.__setattr__(self, "reasoning_parser", ReasoningParserKind(self.reasoning_parser))
        if self.tool_call_parser is not None:
            object.__setattr__(self, "tool_call_parser", ToolCallParserKind(self.tool_call_parser))

    def app_options(self) -> dict[str, Any]:
        """create_app's keywords: every setting but where to listen."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("host", "port")}


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """`ifb run` with several models (runtime/server/model_router.py): where they come from besides
    the TARGETs, and how many stay loaded."""

    models_dir: str | None = option(
        None,
        "Serve every engine folder and .gguf file in DIR too, each named by its folder name or file stem "
        "(a .gguf is built on its first request, as a SOURCE TARGET is).",
    )
    max_loaded_models: int | None = option(
        None,
        "Most models loaded at once: a request for another unloads the least recently used idle one first, "
        "or gets a 503 when every loaded one is busy. Default: no bound.",
        minimum=1,
    )
    idle_unload_s: float | None = option(
        None, "Unload a model no request has used for this many seconds (it loads again on the next).", minimum=0
    )
    models_memory_gb: float | None = option(
        None,
        "GB (10^9 bytes) the loaded models may hold (each: weights + KV pool + 256 MiB overhead, from engine.json; "
        "a GGUF not built yet is estimated from its size): a request for another unloads the least recently used "
        "idle ones first, or gets a 503 when it cannot fit. Default: no bound.",
        flag="--models-memory",
        minimum=0,
    )

    def __post_init__(self) -> None:
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise LimitExceededError(
                f"--max-loaded-models (max_loaded_models) must be >= 1, got {self.max_loaded_models}"
            )
        if self.idle_unload_s is not None and not self.idle_unload_s > 0:
            raise LimitExceededError(f"--idle-unload-s (idle_unload_s) must be > 0, got {self.idle_unload_s:g}")
        if self.models_memory_gb is not None and not self.models_memory_gb > 0:
            raise LimitExceededError(f"--models-memory (models_memory_gb) must be > 0, got {self.models_memory_gb:g}")
        if self.models_dir is not None and not Path(self.models_dir).is_dir():
            raise LimitExceededError(f"--models-dir (models_dir) {self.models_dir} is not a directory")

    @property
    def in_use(self) -> bool:
        """Whether any router flag was given (one model and none of them: today's one-model app)."""
        return any(getattr(self, f.name) is not None for f in fields(self))


def _listening(name: str) -> Any:
    """ServerSettings' field `name` again, set by no flag of its own (`ifb serve` reads --host and
    --port through ServerSettings, as `ifb run` does)."""
    spec = next(f for f in fields(ServerSettings) if f.name == name)
    return field(default=spec.default, metadata={**spec.metadata, "cli": False})


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How `ifb serve` deploys replicas on Ray Serve (ifb/ray_serve/deploy.py). Here, not there:
    the CLI builds its options from these fields when it is imported, and nothing outside
    ifb/ray_serve may import that subpackage before `ifb serve` runs."""

    num_replicas: int = option(2, "Engine replicas.", minimum=1, flag="--replicas")
    threads_per_replica: int = option(
        1, "Compute threads of each replica (and the CPUs Ray reserves for it).", minimum=1, aliases=("--threads",)
    )
    ray_address: str | None = option(None, "Join this Ray cluster (default: start a local instance).")
    host: str = _listening("host")
    port: int = _listening("port")
    stats_period_s: float = option(0.5, "How often replicas report load, health and metrics.", cli=False)
    health_check_period_s: float = option(1.0, "How often Serve checks each replica.", cli=False)
    app_options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})  # create_app's keywords


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """The settings in force: the engine's limits where a setting left them, the rest as given."""

    max_batch_size: int
    max_num_tokens: int
    max_queued_requests: int
    queue_timeout: float | None
    guided_compile_timeout: float
    policy: CapacityPolicyKind
    chunking: ChunkingPolicyKind
    enable_prefix_reuse: bool
    default_max_tokens: int
    num_kv_blocks: int  # blocks the scheduler may use, <= the engine's pool
    itl_target_ms: float | None  # as RuntimeSettings: None = default, 0 = off
    ttft_target_ms: float | None  # as RuntimeSettings: None = default, 0 = off
    calibrate: bool
    speculation: SpeculativeConfig
    prefix_disk_tier: PrefixDiskTierConfig | None = None  # --prefix-cache-dir: None = no disk tier


def check_minimums(settings: RuntimeSettings) -> None:
    """Each setting against its field's `minimum` (None, the engine's value, passes)."""
    for spec in fields(settings):
        minimum, value = spec.metadata.get("minimum"), getattr(settings, spec.name)
        if minimum is not None and value is not None and not value >= minimum:  # `not >=`: NaN fails too
            raise LimitExceededError(f"{spec.name} must be >= {minimum}, got {value}")


def check_first_token_target(engine: EngineConfig, settings: RuntimeSettings) -> None:
    """A ttft target only grows a step's prompt chunk past the inter-token target's, so without
    an inter-token target (0) it would do nothing: refused, not ignored. An engine without a cost
    model serves conservatively until idle turns have timed one; the targets apply from then on."""
    ttft, itl = settings.ttft_target_ms, settings.itl_target_ms
    if not ttft:  # None (the default follows the inter-token target) or 0 (off)
        return
    if itl != 0:  # an engine without a cost model gets one in idle turns (step_budget/idle_calibration.py)
        return
    reason = "--itl-target-ms (itl_target_ms) 0 turns it off, so every step may already take max_num_tokens"
    raise LimitExceededError(
        f"--ttft-target-ms (ttft_target_ms) {ttft:g} needs an inter-token target: {reason}; "
        "drop --ttft-target-ms or give --itl-target-ms a target in ms"
    )


def prefix_disk_tier_config(settings: RuntimeSettings) -> PrefixDiskTierConfig | None:
    """--prefix-cache-dir and --prefix-cache-disk-gb as the tier's config; a size without a
    directory, a directory without prefix reuse, or a size of 0 is refused, not ignored."""
    directory, gb = settings.prefix_cache_dir, settings.prefix_cache_disk_gb
    if directory is None:
        if gb is not None:
            raise LimitExceededError(
                f"--prefix-cache-disk-gb (prefix_cache_disk_gb) {gb:g} needs --prefix-cache-dir (prefix_cache_dir)"
            )
        return None
    if not settings.enable_prefix_reuse:
        raise LimitExceededError(
            "--prefix-cache-dir (prefix_cache_dir) keeps prefix-cache blocks, but prefix reuse is off "
            "(--no-enable-prefix-reuse); drop one of them"
        )
    if gb is not None and not gb > 0:
        raise LimitExceededError(f"--prefix-cache-disk-gb (prefix_cache_disk_gb) must be > 0, got {gb:g}")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise LimitExceededError(f"--prefix-cache-dir (prefix_cache_dir) {directory} exists and is not a directory")
    max_gb = DEFAULT_PREFIX_CACHE_DISK_GB if gb is None else gb
    return PrefixDiskTierConfig(path, int(max_gb * BYTES_PER_GB))


def resolve_runtime_config(engine: EngineConfig, settings: RuntimeSettings) -> RuntimeConfig:
    """Runtime values may lower a baked limit, never raise it."""
    check_minimums(settings)
    check_first_token_target(engine, settings)
    requested = {
        "max_batch_size": settings.max_batch_size,
        "max_num_tokens": settings.max_num_tokens,
        "num_kv_blocks": settings.kv_blocks,
    }
    for name, value in requested.items():
        baked = getattr(engine.limits, name)
        if value is not None and value > baked:
            build_name = "kv_blocks" if name == "num_kv_blocks" else name
            raise LimitExceededError(
                f"{name} {value} exceeds the engine's baked limit {name}={baked}; rebuild with: "
                + engine.rebuild_command(**{build_name: value})
            )
    batch = settings.max_batch_size or engine.limits.max_batch_size
    tokens = settings.max_num_tokens or engine.limits.max_num_tokens
    if tokens < batch:
        raise LimitExceededError(f"max_num_tokens {tokens} must be >= max_batch_size {batch}")
    if tokens < engine.limits.block_size:
        raise LimitExceededError(f"max_num_tokens {tokens} must be >= block_size {engine.limits.block_size}")
    as_given = {f.name: getattr(settings, f.name) for f in fields(RuntimeConfig) if hasattr(settings, f.name)}
    return RuntimeConfig(
        **{
            **as_given,
            "max_batch_size": batch,
            "max_num_tokens": tokens,
            "num_kv_blocks": settings.kv_blocks or engine.limits.num_kv_blocks,
            "speculation": settings.speculation(),
            "prefix_disk_tier": prefix_disk_tier_config(settings),
        }
    )
