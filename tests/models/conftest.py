"""SmolLM2, loaded once for every test of this folder that needs the real weights (the
load takes about 15 s; a module-scoped copy each paid it again)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2() -> Iterator[Any]:
    from bench.generative.exactness import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine is shared
    try:
        yield load_model()
    finally:
        torch.set_num_threads(threads)
