"""Frontend: a caller's prompt and parameters -> a validated Request ready for the engine.

Tokenizing, the chat template, validation against the engine's limits and compiling a guided
constraint all happen here, on the caller's thread (or a worker thread for async callers) and
never on the executor's. Nothing here touches the scheduler.
"""

from __future__ import annotations

import inspect
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from ifb.runtime.admission import check_prompt, unset_max_tokens
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided_pool import GrammarCompiler
from ifb.runtime.reasoning import THINK_CLOSE, THINK_OPEN
from ifb.runtime.request import Request, RequestTimes
from ifb.runtime.runtime_config import RuntimeConfig
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.unicode_text import require_unicode, require_unicode_strings
from ifb.runtime.windowed_kv_cache_manager import SlidingWindowBlocks

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed every check, with its compiled constraint (if guided)."""

    request: Request
    compiled_grammar: Any = None
    grammar_compile_s: float = 0.0


class Frontend:
    def __init__(
        self, engine: EngineConfig, config: RuntimeConfig, tokenizer: Any, chat_template: str | None = None
    ) -> None:
        self.engine = engine
        self.chat_template = chat_template or tokenizer.chat_template
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(engine.spec.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        self._reserved_template_names = _call_parameters(tokenizer.apply_chat_template) | {"messages"}
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        limits = engine.limits
        self.kv_window = SlidingWindowBlocks.for_model(
            engine.spec, limits.block_size, limits.max_seq_len, config.max_num_tokens
        )
        # What a request must fit in (admission.py): the sequence limit and the KV pool's blocks.
        self._kv_room = {
            "max_seq_len": limits.max_seq_len,
            "max_blocks": config.num_kv_blocks,
            "block_size": limits.block_size,
        }

    def token_text(self, token_id: int) -> str:
        """One token as text (logprobs show it): its own decoding, special tokens included."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def detokenize(self, token_ids: list[int]) -> str:
        self._check_token_ids(token_ids, "tokens", "tokens")
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def _check_token_ids(self, token_ids: list[int], what: str, field: str) -> None:
        vocab = self.engine.spec.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise AdmissionError(f"{what} must be integers in [0, {vocab})", field=field)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            require_unicode(prompt, "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        self._check_token_ids(prompt, "prompt token ids", "prompt")
        return list(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt; `chat_template_kwargs` are more variables the template sees (vLLM's
        field: Qwen3's `enable_thinking`, say), JSON values not named like the call's own."""
        if not self.chat_template:
            raise AdmissionError("this engine's tokenizer has no chat template", field="messages")
        for index, message in enumerate(messages):
            if isinstance(message.get("content"), str):
                require_unicode(message["content"], f"messages.{index}.content")
        variables = _template_variables(chat_template_kwargs, self._reserved_template_names)
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **variables,
        )
        return list(ids)

    def prepare(self, prompt_token_ids: list[int], params: SamplingParams) -> PreparedRequest:
        """Validate against the engine's limits and compile the constraint; raises
        AdmissionError naming the field. Blocking (a compile may take seconds): async callers
        run it on a worker thread."""
        params.check_vocab(self.engine.spec.vocab_size)
        num_prompt_tokens = len(prompt_token_ids)
        check_prompt(num_prompt_tokens, params.max_tokens, window=self.kv_window, **self._kv_room)
        max_tokens = params.max_tokens
        if max_tokens is None:
            default = self.config.default_max_tokens
            max_tokens = unset_max_tokens(num_prompt_tokens, default, window=self.kv_window, **self._kv_room)
        if params.reasoning_budget is not None:
            params = replace(params, reasoning_budget=params.reasoning_budget.with_tags(*self.think_tags))
        compiled, seconds = (None, 0.0)
        if params.guided is not None:
            compiled, seconds = self.grammar_compiler().compile(params.guided)
        request = Request(
            request_id=f"req-{self._id_prefix}-{next(self._ids)}",
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            max_tokens=max_tokens,
            times=RequestTimes(arrival=time.perf_counter()),
            eos_token_ids=self.eos_token_ids,
        )
        return PreparedRequest(request, compiled, seconds)

    @cached_property
    def think_tags(self) -> tuple[list[int], list[int]]:
        """`<think>` and `</think>` as this tokenizer encodes each alone (a reasoning budget's tags)."""
        encode = self.tokenizer.encode
        return encode(THINK_OPEN, add_special_tokens=False), encode(THINK_CLOSE, add_special_tokens=False)

    def close(self) -> None:
        with self._grammar_lock:
            if self._grammars is not None:
                self._grammars.close()

    def start_grammar_compiler(self, start_gate: threading.Event | None = None) -> GrammarCompiler:
        """Start the compile workers now, in the background, so the first guided request finds one
        warm (the LLM does at start); a running compiler is closed first. `start_gate`, when
        given, holds each worker start until it is set."""
        with self._grammar_lock:
            if self._grammars is not None:
                self._grammars.close()
            stop, budget = sorted(self.eos_token_ids), self.config.guided_compile_timeout
            self._grammars = GrammarCompiler(self.tokenizer, self.engine.spec.vocab_size, stop, budget, start_gate)
            return self._grammars

    def grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammars is not None:
                return self._grammars
        return self.start_grammar_compiler()


def _call_parameters(function: Callable[..., Any]) -> frozenset[str]:
    """The named parameters of `function` (not its **kwargs)."""
    parameters = inspect.signature(function).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)


def _template_variables(given: Mapping[str, Any] | None, reserved: frozenset[str]) -> dict[str, Any]:
    """`chat_template_kwargs` checked: an object of JSON values whose names are not the
    template call's own (`tokenize`, `messages`, ...: those would change the call, not the
    template); else an AdmissionError naming the field."""
    field = "chat_template_kwargs"
    if given is None:
        return {}
    if not isinstance(given, Mapping) or not all(isinstance(name, str) for name in given):
        raise AdmissionError(f"{field} must be an object with string keys", field=field)
    if taken := sorted(reserved & given.keys()):
        raise AdmissionError(f"{field} may not set {', '.join(taken)}: the server sets those itself", field=field)
    try:
        json.dumps(dict(given), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise AdmissionError(f"{field} must hold JSON values only: {error}", field=field) from None
    require_unicode_strings(dict(given), field)
    return dict(given)
