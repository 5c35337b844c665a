"""Grammars compiled off the generate loop, and the requests that wait for theirs.

`GrammarCompiler` compiles a request's constraint (models/structured_params.py) into an
llguidance matcher on a small thread pool (llguidance releases the GIL while it builds a
grammar), under llguidance's resource limits (LIMITS), and keeps the result by the
constraint's text: the next request with the same schema copies the compiled matcher at
once. A grammar llguidance refuses is kept too (its error), so a repeat is refused at once.
llguidance builds its lexer lazily, so a regex that explodes (.*a.{40}) compiles at once
and grows by states with every token; the compile thread therefore walks a probe matcher
through PROBE_TOKENS seeded random tokens under PROBE_STATES lexer states (`explodes`) and
refuses the grammar whose walk runs out. A matcher that still fails while generating (one
that grows slowly, as (a|b)*a(a|b){40} at ~10 states a token, or a `pattern` deep in a
schema the walk missed) allows only EOS at MAX_LEXER_STATES, and the loop ends that one
sequence with an error (execution/grammar_mask.py `failures`).

`GrammarGate` holds a request whose grammar is still compiling, so the loop keeps stepping
the others; the loop takes it back (`ready`) once its compile is done or over
COMPILE_LIMIT_S. `matcher` then gives its own matcher, or raises GrammarRefused, naming
the payload field, which the loop answers `invalid_request`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from worker.execution.grammar_mask import mask_vocab
from worker.models.structured_params import Constraint
from worker.policy.batching import Pending
from worker.streams.token_streams import Progress

log = structlog.get_logger("redbatch.worker")
COMPILE_THREADS = 2
COMPILE_LIMIT_S = 5.0  # a compile still running then is refused (it ends on its own limits)
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped
ERROR_CHARS = 300
HELD = object()  # GrammarGate.take: the request waits for its grammar
MAX_LEXER_STATES = 50_000  # a matcher's (1-2 kB each); past them it fails, allowing EOS only
PROBE_TOKENS = 512  # the random walk's length through a new grammar (tokens, in all)
# lexer states that walk may build: .*a.{40} needs them in 74 tokens, the schema of
# bench/generative/constrained.py (strings of maxLength 160) 1,000-2,000 in all
PROBE_STATES = 10_000


def parser_limits(lexer_states: int = MAX_LEXER_STATES) -> Any:
    """llguidance's resource limits, below its defaults where a hostile grammar hurts."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=2_000, initial_lexer_fuel=1_000_000,
                          step_lexer_fuel=200_000, step_max_items=50_000,
                          max_lexer_states=lexer_states, max_grammar_size=200_000,
                          verbose_errors=False)


def explodes(tokenizer: Any, grammar: str, eos: list[int]) -> str | None:
    """llguidance's error where seeded walks of PROBE_TOKENS random allowed tokens in all
    through the grammar need over PROBE_STATES lexer states (or fail otherwise), else None.
    Plain Python on the mask's bytes: torch's threads would contend with the loop's."""
    from llguidance import LLMatcher

    probe = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits(PROBE_STATES))
    rng = random.Random(0)
    for _ in range(PROBE_TOKENS):
        mask = probe.compute_bitmask()
        if probe.is_error():
            break
        token = random_token(mask, rng, eos)
        if probe.is_stopped() or token is None:
            probe.reset()  # walk again from the start: its lexer states stay built
        else:  # a refused token shows in is_error
            probe.consume_token(token)
    return probe.get_error() if probe.is_error() else None


def random_token(mask: bytes, rng: random.Random, eos: list[int]) -> int | None:
    """A token of a random non-zero byte of the mask (one bit per token), not EOS."""
    filled = [i for i, byte in enumerate(mask) if byte]
    if not filled:
        return None
    at = rng.choice(filled)
    tokens = [at * 8 + bit for bit in range(8) if mask[at] >> bit & 1 and at * 8 + bit not in eos]
    return rng.choice(tokens) if tokens else None


def short(error: str) -> str:
    """llguidance's error cut to ERROR_CHARS (it may quote the whole grammar)."""
    return error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS] + "..."


class GrammarRefused(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class GrammarCompiler:
    """Compiles constraints into llguidance matchers on its own threads, cached by text."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Any,
                 threads: int = COMPILE_THREADS) -> None:
        self._hf, self._eos = tokenizer, sorted(eos_ids)
        self._vocab = mask_vocab(vocab, tokenizer)  # as wide as the engine's masks
        self._tokenizer: Any = None  # llguidance's, built with the first compile (~0.3 s)
        self._lock = threading.Lock()  # the cache's (held by the loop: never for long)
        self._building = threading.Lock()  # the tokenizer's, built on a compile thread
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()

    def compile(self, constraint: Constraint) -> Future[Any]:
        """The compile of this constraint (a cached one if its text was seen): its result is
        a matcher to copy, or llguidance's error message (a str)."""
        key = (constraint.kind, constraint.source)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._build, constraint)
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return future

    def _build(self, constraint: Constraint) -> Any:
        from llguidance import LLMatcher

        started = time.perf_counter()
        try:
            grammar = constraint.grammar()
        except (ValueError, RecursionError) as exc:
            return f"llguidance cannot read it: {exc}"
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0, limits=parser_limits())
        error = matcher.get_error() if matcher.is_error() else \
            explodes(self.tokenizer(), grammar, self._eos)
        log.info("grammar.compiled", kind=constraint.kind, chars=len(constraint.source),
                 ms=round((time.perf_counter() - started) * 1000, 1), ok=error is None)
        if error is not None and "too many states" in error:
            return (f"its lexer grows past {PROBE_STATES} states within {PROBE_TOKENS} "
                    f"tokens (a regex that explodes): {error}")
        return matcher if error is None else error

    def tokenizer(self) -> Any:
        """llguidance's tokenizer of the model (its vocabulary as wide as the logits)."""
        with self._building:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(byte_level_json(self._hf), n_vocab=self._vocab,
                                              eos_token=self._eos)
            return self._tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarGate:
    """The requests waiting for their grammar, and each admitted one's own matcher."""

    def __init__(self, compiler: GrammarCompiler, wake: Callable[[], None],
                 limit_s: float = COMPILE_LIMIT_S) -> None:
        self.compiler, self.wake, self.limit_s = compiler, wake, limit_s
        self.waiting: dict[str, tuple[Pending, Progress | None, Future[Any], float]] = {}
        self.late: set[str] = set()  # taken back before their compile ended: refused

    def take(self, pending: Pending, progress: Progress | None) -> Any:
        """The request's own matcher (None without a grammar), or HELD: it waits here for
        its grammar until `ready`. GrammarRefused for a grammar llguidance refused."""
        constraint = pending.item.data.params.constraint
        if constraint is None:
            return None
        future = self.compiler.compile(constraint)
        if future.done() or pending.entry_id in self.late:
            self.late.discard(pending.entry_id)
            return self.matcher(constraint)
        self.waiting[pending.entry_id] = (pending, progress, future, time.monotonic())
        future.add_done_callback(lambda _: self.wake())
        return HELD

    def due(self) -> bool:
        """Whether a held request can be taken back (its compile done or over its time)."""
        now = time.monotonic()
        return any(f.done() or now - since > self.limit_s
                   for _, _, f, since in list(self.waiting.values()))

    def ready(self) -> list[tuple[Pending, Progress | None]]:
        """The held requests whose compile is done or over its time, no longer held."""
        now = time.monotonic()
        done = [i for i, (_, _, f, since) in self.waiting.items()
                if f.done() or now - since > self.limit_s]
        self.late.update(i for i in done if not self.waiting[i][2].done())
        return [self.waiting.pop(i)[:2] for i in done]

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher of the constraint's compiled grammar."""
        future = self.compiler.compile(constraint)
        if not future.done():
            raise GrammarRefused(f"'{constraint.field}': its grammar took over "
                                 f"{self.limit_s:g} s to compile", constraint.field)
        compiled = future.result() if future.exception() is None else str(future.exception())
        if isinstance(compiled, str):
            raise GrammarRefused(f"'{constraint.field}' is not a grammar llguidance can "
                                 f"enforce: {short(compiled)}", constraint.field)
        return compiled.deep_copy()


def byte_level_json(hf_tokenizer: Any) -> str:
    """The fast tokenizer's JSON, as llguidance.hf.from_tokenizer builds it, with a
    byte-level pre-tokenizer's decoder set to ByteLevel: llguidance reads a token's bytes
    from the decoder, and transformers 5.0 gives SmolLM2's GGUF tokenizer a Sequence
    decoder, which made it read "Ġ:" as the bytes C4 A0 3A and refuse the tokens it had
    allowed (written by hand: llguidance has no option for it)."""
    import json
    from copy import copy

    if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
        raise ValueError("only fast tokenizers are supported")  # as from_tokenizer says
    backend = copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    if (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel" and \
            (spec.get("decoder") or {}).get("type") != "ByteLevel":
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True}
    return json.dumps(spec)
