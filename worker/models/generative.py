"""`causal_lm`: any Hugging Face causal language model from a local path, served by
continuous batching (pipeline/generate.py, its engine built by
execution/generation.py's `engine_for`) instead of collate/forward/postprocess.

model_options: `path` (a from_pretrained directory), `gguf_file` (a GGUF file in it),
`max_new_tokens` (default per request, 128), `max_new_tokens_limit` (1024), and the
scheduler's knobs (policy/decoding.py): `max_step_tokens` (512), `max_seqs` (16),
`kv_cache_bytes` (256 MiB of KV cache), `max_wait_steps` (32), `prefill_first` (true: a
step that can admit new requests prefills only them, so their first token does not wait for
every running sequence's decode) and `prefill_streak` (1: the most such steps in a row).
The weights and the KV pool are in the `dtype` setting's dtype (auto: bfloat16 on CUDA >=
8.0, float32 on a CPU), and the KV budget counts that dtype's bytes per element. Nothing is
downloaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from worker.models import weights_cache
from worker.models.base import InvalidInput, Model, Prepared
from worker.models.chat_messages import for_template
from worker.models.generation_params import (
    GenerationInput,
    fork_of,
    prompt_of,
    sampling_params,
    wants_stream,
)
from worker.policy.decoding import SchedulerLimits

GGUF_DTYPE = torch.float32  # "float32" in the cache key: what a GGUF is dequantised to
PREFIX_CHARS_PER_TOKEN = 8  # twice English's 4: a prefix this long shows most overflows


def context_window(config: Any) -> int:
    text = config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(text, name, None):
            return int(getattr(text, name))
    raise ValueError("the model's config names no context window")


def context_of(lm: Any) -> int:
    """The longest sequence the model takes (no limit of its own: the pool's)."""
    try:
        return context_window(lm.config)
    except ValueError:
        return 1 << 30


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


class CausalLM(Model):
    generative = True
    default_bucket_boundaries: Sequence[int] = ()  # one FIFO queue: the scheduler orders

    def __init__(self, path: str, gguf_file: str | None = None, max_new_tokens: int = 128,
                 max_new_tokens_limit: int = 1024, max_step_tokens: int = 512,
                 max_seqs: int = 16, kv_cache_bytes: int = 256 << 20,
                 max_wait_steps: int = 32, prefill_first: bool = True,
                 prefill_streak: int = 1, overlap_steps: bool | None = None) -> None:
        if not 1 <= max_new_tokens <= max_new_tokens_limit:
            raise ValueError("need 1 <= max_new_tokens <= max_new_tokens_limit")
        self.path, self.gguf_file = path, gguf_file
        # launch step n + 1 before step n's host work (vLLM's async scheduling); None: on a GPU
        self.overlap_steps = overlap_steps
        self.max_new_tokens, self.max_new_tokens_limit = max_new_tokens, max_new_tokens_limit
        self.limits = SchedulerLimits(  # checked now, at start-up; bytes_per_token at load
            max_step_tokens=max_step_tokens, max_seqs=max_seqs,
            kv_budget_bytes=kv_cache_bytes, max_wait_steps=max_wait_steps,
            prefill_first=prefill_first, prefill_streak=prefill_streak)

    def load(self, device: torch.device) -> None:
        tokenizer, lm = self._pretrained()
        self.tokenizer = tokenizer
        # in the `dtype` setting's dtype, and so is the KV pool
        self.lm = lm.to(device=device, dtype=self.dtype).eval()
        self.device = device
        self.context = context_window(self.lm.config)
        self.longest_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        eos = self.lm.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in [*eos_ids, self.tokenizer.eos_token_id]
                        if e is not None}

    def _pretrained(self) -> tuple[Any, Any]:
        """(tokenizer, model); a GGUF file's conversion comes from the cache when the worker
        gives one (models/weights_cache.py): dequantising it is most of a start."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        def from_path(path: Path, gguf: dict[str, Any]) -> tuple[Any, Any]:
            weights = {"dtype": GGUF_DTYPE if self.gguf_file else self.dtype}
            return (AutoTokenizer.from_pretrained(path, **gguf),
                    AutoModelForCausalLM.from_pretrained(path, **gguf, **weights))

        gguf = {"gguf_file": self.gguf_file} if self.gguf_file else {}
        if not self.gguf_file or self.cache_dir is None:
            return from_path(Path(self.path), gguf)
        return weights_cache.load_or_convert(
            self.cache_dir, Path(self.path) / self.gguf_file, "float32",
            lambda: from_path(Path(self.path), gguf), lambda entry: from_path(entry, {}))

    def limit_kv_cache(self, budget_bytes: int) -> None:
        """Lower the KV budget (the memory governor's watermark, app.generation_parts)."""
        self.limits = dataclasses.replace(self.limits, kv_budget_bytes=budget_bytes)

    def scheduler_limits(self) -> SchedulerLimits:
        per_token = kv_bytes_per_token(self.lm.config, self.lm.dtype)
        return dataclasses.replace(self.limits, bytes_per_token=per_token)

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        prompt = prompt_of(payload)
        ids = self._prompt_ids(prompt)
        params = sampling_params(payload, len(ids), self.context, self.max_new_tokens,
                                 self.max_new_tokens_limit, self.lm.config.vocab_size)
        return Prepared(len(ids), GenerationInput(ids, params, wants_stream(payload),
                                                  fork_of=fork_of(payload)))

    def _prompt_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        tokenizer = self.tokenizer
        if isinstance(prompt, list):
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidInput("this model has no chat template: send 'prompt'", "messages")
            text = self._chat_text(prompt)
            self._refuse_sure_overflow(text)
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        else:
            self._refuse_sure_overflow(prompt)
            ids = list(tokenizer(prompt).input_ids)
        if not ids and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id]
        if not ids:
            raise InvalidInput("'prompt' is empty", "prompt")
        return ids

    def _chat_text(self, messages: list[dict[str, Any]]) -> str:
        """The messages through the chat template; a template that refuses them (its
        `raise_exception`, e.g. "Conversation roles must alternate") refuses the request."""
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        try:
            shaped = for_template(messages, str(self.tokenizer.chat_template))
            return str(self.tokenizer.apply_chat_template(shaped, tokenize=False,
                                                          add_generation_prompt=True))
        except TemplateSyntaxError:
            raise  # a broken template is the model's fault, not the request's
        except (TemplateError, ValueError) as exc:
            raise InvalidInput(f"the chat template refused the messages: {exc}",
                               "messages") from None

    def _refuse_sure_overflow(self, text: str) -> None:
        """Refuse a text sure to overflow the context window before tokenising it whole (a
        1 MiB prompt takes the reader thread 0.7 s): one longer than the window's tokens at
        the vocabulary's longest token cannot fit, nor can one whose first 8 characters per
        window token already make more tokens than the window holds."""
        head = self.context * PREFIX_CHARS_PER_TOKEN
        if len(text) > self.context * self.longest_token or (
                len(text) > head and
                len(self.tokenizer(text[:head], add_special_tokens=False).input_ids)
                > self.context):
            raise InvalidInput(f"prompt is {len(text)} characters, more tokens than the "
                               f"context window of this model ({self.context} tokens)",
                               reason="context_window")

    def answers_on_stream(self, payload: Any) -> bool:
        return wants_stream(payload)

    def collate(self, items: Sequence[Prepared]) -> Any:
        raise NotImplementedError("a generative model is served by the generate loop")

    def forward(self, batch: Any) -> Any:
        raise NotImplementedError("a generative model is served by the generate loop")

    def postprocess(self, output: Any, items: Sequence[Prepared]) -> list[Any]:
        raise NotImplementedError("a generative model is served by the generate loop")
