"""The batched decoding engine: runs the scheduler's StepPlan on a Hugging Face causal LM.

KV caches are kept per sequence (a tuple of (keys, values) per layer, each [1, heads,
tokens, head_dim], no padding inside). A step runs:

- each prefill chunk alone (batch of one: its cache so far + the chunk), so a long prompt
  never pads its batch-mates;
- every decoding sequence together in one forward: their caches left-padded to the longest
  and stacked, a 2-D attention mask that hides the padding, and explicit `position_ids`
  (each row's own length: `cumsum(mask) - 1` at the new token), since the default
  (`arange + past length`) is wrong for padded rows. Each row's cache is then its row of
  the result, padding stripped (a view, no copy).

Preempted sequences lose their cache; their next prefill recomputes it from their tokens.
Torch only: no Redis, no threads (the generate loop, pipeline/generate.py, calls it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from worker.execution.sampling import Delta, SamplingParams, TextState, choose_token
from worker.policy.decoding import StepPlan, Work

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class EngineSeq:
    id: str
    prompt_ids: list[int]
    text: TextState
    generator: torch.Generator
    cache: list[LayerKV] | None = None
    cached: int = 0  # tokens in `cache`

    def tokens(self, start: int, end: int) -> list[int]:
        every = self.prompt_ids + self.text.generated
        return every[start:end]


@dataclass(slots=True)
class StepOutput:
    deltas: list[Delta] = field(default_factory=list)  # one per sequence that sampled

    @property
    def finished(self) -> list[str]:
        return [d.id for d in self.deltas if d.finish_reason]


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """2 (keys and values) x layers x KV heads x head dim x bytes per element."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or text.n_embd
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class GenerationEngine:
    def __init__(self, lm: Any, tokenizer: Any, device: torch.device,
                 eos_ids: Iterable[int] = ()) -> None:
        self.lm = lm
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = frozenset(eos_ids)
        self.seqs: dict[str, EngineSeq] = {}

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
        return self.seqs.pop(seq_id, None)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        for seq_id in plan.preempted:
            seq = self.seqs[seq_id]
            seq.cache, seq.cached = None, 0
        logits: dict[str, torch.Tensor] = {}
        decode = [w for w in plan.decode if w.start > 0]  # a 1-token prompt has no cache
        for work in plan.prefill + [w for w in plan.decode if w.start == 0]:
            logits[work.id] = self._prefill(self.seqs[work.id], work)
        if decode:
            logits.update(self._decode(decode))
        output = StepOutput()
        for work in plan.work:
            if work.emits:
                seq = self.seqs[work.id]
                state = seq.text
                token = choose_token(logits[work.id], state.params, len(state.generated),
                                     seq.generator)
                output.deltas.append(state.append(seq.id, token, self.decode))
        return output

    def _prefill(self, seq: EngineSeq, work: Work) -> torch.Tensor:
        """One chunk alone, on top of the sequence's cache so far."""
        assert seq.cached == work.start, (seq.id, seq.cached, work.start)
        ids = torch.tensor([seq.tokens(work.start, work.end)], device=self.device)
        cache = DynamicCache(ddp_cache_data=seq.cache) if seq.cache else DynamicCache()
        out = self.lm(input_ids=ids, cache=cache, use_cache=True,
                      attention_mask=torch.ones(1, work.end, dtype=torch.long,
                                                device=self.device),
                      position_ids=torch.arange(work.start, work.end,
                                                device=self.device)[None],
                      logits_to_keep=1)
        seq.cache = [(layer.keys, layer.values) for layer in out.cache.layers]
        seq.cached = work.end
        return out.logits[0, -1]

    def _decode(self, works: Sequence[Work]) -> dict[str, torch.Tensor]:
        """One token for each sequence, all in one left-padded forward."""
        seqs = [self.seqs[w.id] for w in works]
        pasts = [s.cached for s in seqs]
        longest = max(pasts)
        cache = DynamicCache(ddp_cache_data=stacked(seqs, longest)) if longest else \
            DynamicCache()
        mask = torch.zeros(len(seqs), longest + 1, dtype=torch.long, device=self.device)
        for row, past in enumerate(pasts):
            mask[row, longest - past:] = 1
        positions = (mask.cumsum(-1) - 1)[:, -1:]
        ids = torch.tensor([s.tokens(w.start, w.end) for s, w in zip(seqs, works, strict=True)],
                           device=self.device)
        out = self.lm(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask,
                      position_ids=positions, logits_to_keep=1)
        layers = [(layer.keys, layer.values) for layer in out.cache.layers]
        for row, seq in enumerate(seqs):
            pad = longest - pasts[row]
            seq.cache = [(k[row:row + 1, :, pad:], v[row:row + 1, :, pad:]) for k, v in layers]
            seq.cached = pasts[row] + 1
        return {s.id: out.logits[row, -1] for row, s in enumerate(seqs)}


def stacked(seqs: Sequence[EngineSeq], longest: int) -> list[LayerKV]:
    """The sequences' caches, each left-padded with zeros to `longest`, as one batch."""
    layers = []
    for layer in range(len(next(s.cache for s in seqs if s.cache))):
        keys, values = [], []
        for seq in seqs:
            assert seq.cache is not None
            k, v = seq.cache[layer]
            pad = longest - seq.cached
            keys.append(F.pad(k, (0, 0, pad, 0)) if pad else k)
            values.append(F.pad(v, (0, 0, pad, 0)) if pad else v)
        layers.append((torch.cat(keys), torch.cat(values)))
    return layers
