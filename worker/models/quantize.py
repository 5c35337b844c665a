"""`dtype int8`: the encoder kinds' linear layers as dynamic int8 (weights int8 per
channel, activations quantized per batch at run time, accumulation in int32 on VNNI or
AMX-int8), through PyTorch's own `quantize_dynamic`; everything else stays float32.

`torch.ao.quantization` is deprecated in PyTorch 2.13 in favour of the torchao package's
`quantize_`, which would be a new dependency; its eager dynamic path still ships and runs,
so its deprecation warnings are silenced here, once, where it is called.
"""

from __future__ import annotations

import warnings

import torch

INT8 = "int8"


def quantized_int8(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (float32, on the CPU) with every nn.Linear replaced by its dynamic int8 twin."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        # per output channel: one scale per row of the weight (per tensor lost more)
        quantized: torch.nn.Module = quantize_dynamic(
            module, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    return quantized
