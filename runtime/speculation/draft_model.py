"""DraftModelProposer: drafts from a second compiled ifb engine with the target's tokenizer
(`--speculative draft --draft-engine DIR`), run greedily for a request just before the step that
verifies its draft.

The draft engine keeps its own KV pool and, per request, the tokens whose K/V it holds. A proposal
first catches up on what the target appended since the last one (the kept drafts' tail and the
target's own token; a new request's whole prompt, in the draft engine's max_num_tokens chunks),
then decodes one token per step. Rejected drafts' K/V are simply overwritten: a request's draft
context is cut back to what matches its real tokens. Verification keeps a draft token only where
it equals the token the target samples there, so any proposer leaves the output unchanged;
greedy drafts maximise how often that holds for greedy requests.

Draft steps run one request at a time (a lone stream is where drafts pay); their time is priced
by the draft engine's own cost model (`draft_ms`), so the planner weighs it with the target's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.request import Request
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs
from ifb.runtime.step_budget.cost_model import StepShape

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftContext:
    """What the draft engine holds for one request."""

    fed: list[int] = field(default_factory=list)  # tokens whose K/V the draft engine holds, in order
    blocks: list[int] = field(default_factory=list)  # the draft pool's blocks holding them
    num_known: int = 0  # of `fed`, the leading tokens that were the request's own (not drafts)


def check_same_tokenizer(target: EngineConfig, draft: EngineConfig, folder: str) -> None:
    """The draft's token ids must mean the target's: same vocabulary size and tokenizer file."""
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise LimitExceededError(
            f"draft_engine {folder}: vocab_size {draft.spec.vocab_size} differs from the target's "
            f"{target.spec.vocab_size}; a draft engine needs the target's tokenizer"
        )
    ours, theirs = target.tokenizer_path / "tokenizer.json", draft.tokenizer_path / "tokenizer.json"
    if ours.is_file() != theirs.is_file() or (ours.is_file() and ours.read_bytes() != theirs.read_bytes()):
        raise LimitExceededError(
            f"draft_engine {folder}: tokenizer.json differs from the target's; a draft engine needs the target's tokenizer"
        )


class DraftModelProposer:
    def __init__(self, folder: str, mode: StepMode = StepMode.COMPILED) -> None:
        self.folder = folder
        self.config = EngineConfig.load(Path(folder), verify=False)
        self.mode = mode
        self.engine: Engine | None = None
        self._contexts: dict[str, DraftContext] = {}
        self._free: list[int] = []

    def prepare(self, target: EngineConfig) -> None:
        """Check the draft against the target engine and load it (on the executor thread, as the
        target is loaded, before the first step)."""
        check_same_tokenizer(target, self.config, self.folder)
        if self.engine is None:
            self.engine = Engine(self.config, self.mode)
            self._free = list(range(self.config.limits.num_kv_blocks - 1, -1, -1))
            logger.info("draft engine %s loaded (%d KV blocks)", self.folder, self.config.limits.num_kv_blocks)

    def draft_ms(self, request: Request, num_draft: int) -> float:
        """What proposing `num_draft` tokens is predicted to cost (the draft engine's cost model;
        0 without one): a catch-up chunk (or row), then a decode row per further token."""
        model = self.config.cost_model
        if model is None or num_draft <= 0:
            return 0.0
        context = self._contexts.get(request.request_id)
        start = self._matching(context, request.token_ids) if context is not None else 0
        catch_up = request.num_tokens - start
        if catch_up == 1:
            first = StepShape(num_decode_rows=1, num_decode_context_tokens=request.num_tokens)
        else:
            first = StepShape(catch_up, 0, 0, StepShape.prefill_pairs(start, catch_up))
        decode = sum(
            model.predict_ms(StepShape(num_decode_rows=1, num_decode_context_tokens=request.num_tokens + j))
            for j in range(1, num_draft)
        )
        return model.predict_ms(first) + decode

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        if self.engine is None:
            raise RuntimeError("DraftModelProposer.prepare() was not called before the first step")
        tokens = request.token_ids
        limits = self.config.limits
        max_tokens = min(max_tokens, limits.max_seq_len - len(tokens))
        if max_tokens <= 0:
            return []
        context = self._contexts.setdefault(request.request_id, DraftContext())
        start = self._matching(context, tokens)
        if not self._reserve(context, len(tokens) + max_tokens - 1):
            return []  # the draft pool is full: no draft this step (drafts are optional)
        del context.fed[start:]
        draft = [self._catch_up(context, tokens, start)]
        while len(draft) < max_tokens:
            draft.append(self._run(context, [draft[-1]], len(context.fed)))
        context.num_known = len(tokens)
        return draft

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the draft pool no request's draft context holds."""
        return len(self._free)

    def finished(self, request: Request) -> None:
        context = self._contexts.pop(request.request_id, None)
        if context is not None:
            self._free.extend(reversed(context.blocks))

    @staticmethod
    def _matching(context: DraftContext, tokens: list[int]) -> int:
        """How many leading tokens of `context.fed` are the request's real tokens (only the drafts
        fed after `num_known` need checking: the ones before were real when fed)."""
        held = min(context.num_known, len(context.fed))
        limit = min(len(context.fed), len(tokens) - 1)  # the last token is always computed anew
        while held < limit and context.fed[held] == tokens[held]:
            held += 1
        return min(held, limit)

    def _reserve(self, context: DraftContext, num_tokens: int) -> bool:
        needed = math.ceil(num_tokens / self.config.limits.block_size) - len(context.blocks)
        if needed > len(self._free):
            return False
        for _ in range(max(0, needed)):
            context.blocks.append(self._free.pop())
        return True

    def _catch_up(self, context: DraftContext, tokens: list[int], start: int) -> int:
        """Feed tokens[start:] in chunks the draft engine takes; the last chunk's next token."""
        chunk = self.config.limits.max_num_tokens
        for position in range(start, len(tokens), chunk):  # start < len(tokens): the last is always fed
            token = self._run(context, tokens[position : position + chunk], position)
        return token

    def _run(self, context: DraftContext, piece: list[int], start: int) -> int:
        """One draft step over `piece` at `start`; the greedy next token after it."""
        assert self.engine is not None
        inputs = build_step_inputs(
            [RequestSlice(piece, start, context.blocks, sample=True)], self.config.limits.block_size
        )
        logits = self.engine.step(inputs)
        context.fed.extend(piece)
        return int(torch.argmax(logits[-1]).item())
