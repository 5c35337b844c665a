"""The built-in models by name: torch-free, so that `--help` can list them without loading
torch (worker/models/__init__.py builds them)."""

from __future__ import annotations

BUILTIN = {
    "minilm": "worker.models.minilm:MiniLMModel",
    "encoder": "worker.models.encoder:EncoderModel",
    "reranker": "worker.models.reranker:RerankerModel",
    "echo": "worker.models.echo:EchoModel",
    "causal_lm": "worker.models.generative:CausalLM",
    "smollm2": "worker.models.smollm2:SmolLM2",
}
