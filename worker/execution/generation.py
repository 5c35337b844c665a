"""The batched decoding engine: runs the scheduler's StepPlan on a Hugging Face causal LM.

KV caches live in one paged pool (execution/kv_pool.py): a sequence owns a block table, and
a forward writes only its new tokens' keys and values. A step runs:

- each prefill chunk alone (a batch of one: the chunk on top of its cache so far), so a long
  prompt never pads its batch-mates;
- every decoding sequence together in one forward: one new token per row, each row
  attending to its own tokens (read from the pool, no padding) at explicit `position_ids`
  (its own length), whatever the other rows' lengths.

The model's attention is the engine's own (execution/paged_attention.py, registered through
transformers' AttentionInterface): the step's StepLayout is set for the duration of the
forward (`stepping`), which keeps no cache of its own (`use_cache=False`).

Preempted and finished sequences give their blocks back; a preempted one's next prefill
recomputes its cache from its tokens. Torch only: no Redis, no threads (the generate loop,
pipeline/generate.py, calls it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.execution.kv_pool import KVPool, StepLayout
from worker.execution.paged_attention import stepping, use_paged_attention
from worker.execution.sampling import (
    Delta,
    SamplingParams,
    TextState,
    choose_token,
    choose_tokens,
)
from worker.policy.decoding import StepPlan, Work

DEFAULT_KV_TOKENS = 16384  # an engine built without a budget (tests, tools)


@dataclass(slots=True)
class EngineSeq:
    id: str
    prompt_ids: list[int]
    text: TextState
    generator: torch.Generator
    blocks: list[int] = field(default_factory=list)  # its block table in the pool
    cached: int = 0  # tokens whose keys and values are in its blocks

    def tokens(self, start: int, end: int) -> list[int]:
        every = self.prompt_ids + self.text.generated
        return every[start:end]


@dataclass(slots=True)
class StepOutput:
    deltas: list[Delta] = field(default_factory=list)  # one per sequence that sampled

    @property
    def finished(self) -> list[str]:
        return [d.id for d in self.deltas if d.finish_reason]


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a causal LM's config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or text.n_embd
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """2 (keys and values) x layers x KV heads x head dim x bytes per element."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class GenerationEngine:
    def __init__(self, lm: Any, tokenizer: Any, device: torch.device,
                 eos_ids: Iterable[int] = (), kv_tokens: int = DEFAULT_KV_TOKENS) -> None:
        """`kv_tokens`: the pool's size, the scheduler's KV budget (plus a block per
        sequence for the partly filled last blocks)."""
        self.lm = lm
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = frozenset(eos_ids)
        self.seqs: dict[str, EngineSeq] = {}
        self.pool = KVPool(*kv_shape(lm.config), tokens=kv_tokens, dtype=lm.dtype,
                           device=device)
        use_paged_attention(lm)  # generate() on it still runs transformers' sdpa

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            entropy: int = 0) -> None:
        """`entropy`: seeds the draws of an unseeded sampling request."""
        self.seqs[seq_id] = EngineSeq(seq_id, list(prompt_ids),
                                      TextState(params, self.eos_ids),
                                      torch.Generator().manual_seed(entropy))

    def resume(self, seq_id: str, tokens: Sequence[int], sent_text: str) -> str | None:
        """Continue a sequence after the tokens a previous worker streamed (its next prefill
        covers the prompt and them); returns the finish reason if they had ended it."""
        return self.seqs[seq_id].text.resume(tokens, sent_text, self.decode)

    def drop(self, seq_id: str) -> EngineSeq | None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._forget(seq)
        return seq

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    @torch.inference_mode()
    def step(self, plan: StepPlan,
             on_prefilled: Callable[[Delta], None] | None = None) -> StepOutput:
        """Run the plan. `on_prefilled` is called with each prefilled sequence's new token
        as soon as its own forward is done, before the step's other forwards: its reply
        stream can carry a first token while the other prefills run."""
        for seq_id in plan.preempted:
            self._forget(self.seqs[seq_id])
        output = StepOutput()
        decode = [w for w in plan.decode if w.start > 0]  # a 1-token prompt has no cache
        for work in plan.prefill + [w for w in plan.decode if w.start == 0]:
            seq = self.seqs[work.id]
            logits = self._prefill(seq, work)
            if work.emits:
                output.deltas.append(self._sample(seq, logits))
                if on_prefilled is not None:
                    on_prefilled(output.deltas[-1])
        if decode:
            rows = self._decode(decode)
            output.deltas += self._sample_rows([self.seqs[i] for i in rows],
                                               torch.stack(list(rows.values())))
        return output

    def _sample(self, seq: EngineSeq, logits: torch.Tensor) -> Delta:
        state = seq.text
        token = choose_token(logits, state.params, len(state.generated), seq.generator)
        return self._append(seq, token)

    def _sample_rows(self, seqs: Sequence[EngineSeq], logits: torch.Tensor) -> list[Delta]:
        """One token for each row of a decode forward, chosen together (one argmax, one
        copy of the chosen tokens to the host)."""
        tokens = choose_tokens(logits, [s.text.params for s in seqs],
                               [len(s.text.generated) for s in seqs],
                               [s.generator for s in seqs])
        return [self._append(seq, token) for seq, token in zip(seqs, tokens, strict=True)]

    def _append(self, seq: EngineSeq, token: int) -> Delta:
        delta = seq.text.append(seq.id, token, self.decode)
        if delta.finish_reason:
            self._forget(seq)  # its blocks are free for the next step
        return delta

    def _forget(self, seq: EngineSeq) -> None:
        self.pool.release(seq.blocks)
        seq.cached = 0

    def _prefill(self, seq: EngineSeq, work: Work) -> torch.Tensor:
        """One chunk alone, on top of the sequence's cache so far."""
        assert seq.cached == work.start, (seq.id, seq.cached, work.start)
        return self._forward([seq], [work])[0]

    def _decode(self, works: Sequence[Work]) -> dict[str, torch.Tensor]:
        """One token for each sequence, all in one forward."""
        seqs = [self.seqs[w.id] for w in works]
        return {s.id: row for s, row in zip(seqs, self._forward(seqs, works), strict=True)}

    def _forward(self, seqs: Sequence[EngineSeq], works: Sequence[Work]) -> torch.Tensor:
        """Feed each sequence its work's tokens (rows left-padded to the longest); the
        logits of each row's last token."""
        for seq, work in zip(seqs, works, strict=True):
            self.pool.reserve(seq.blocks, work.end)
        layout = StepLayout(self.pool, [s.blocks for s in seqs], [w.start for w in works],
                            [w.end for w in works])
        ids = torch.zeros(layout.rows, layout.queries, dtype=torch.long)
        for row, (seq, work) in enumerate(zip(seqs, works, strict=True)):
            ids[row, layout.queries - work.tokens:] = torch.tensor(
                seq.tokens(work.start, work.end))
        with stepping(layout):
            out = self.lm(input_ids=ids.to(self.device), use_cache=False,
                          position_ids=layout.positions, logits_to_keep=1)
        if layout.attended != len(self.pool.keys):  # a layer bypassed the pool: wrong tokens
            raise RuntimeError(f"{layout.attended} of {len(self.pool.keys)} layers ran the "
                               "engine's paged attention")
        for seq, work in zip(seqs, works, strict=True):
            seq.cached = work.end
        return out.logits[:, -1]
