"""ONNX Runtime's offline limit for all-MiniLM-L6-v2 on the CPU, at its best configurations.

The bundled MiniLM exported with torch.onnx's TorchScript exporter (dynamo=False: no onnxscript
needed) into a temporary folder at run time; three graphs, each run by the CPU execution
provider with graph optimisation ORT_ENABLE_ALL and intra_op threads = the cores:
  fp32        the export as is
  fp32 fused  onnxruntime.transformers' BERT optimiser (fused attention, GELU, LayerNorm)
  int8        quantize_dynamic's int8 weights (QInt8) of the plain export
bf16 is not offered: the CPU execution provider's bf16 GEMM (fast math) is arm64 only.
Texts are sorted by length, tokenised a batch at a time inside the clock, mean pooled over the
attention mask and L2 normalised, as MiniLM (sentence-transformers) does.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

from bench.peers.systems import Skipped, System, length_order, missing
from worker.models.minilm import MAX_SEQ_LENGTH, bundled_model_path

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
BF16_WHY = "not offered: ONNX Runtime's CPU bf16 GEMM (fast math) is for arm64 only"


class LastHidden(torch.nn.Module):
    """BertModel with positional inputs and one output, as the exporter wants them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state


def export(folder: Path) -> tuple[Path, Any]:
    """The bundled MiniLM as `folder/minilm.onnx` (dynamic batch and length); its config."""
    from transformers import AutoModel, AutoTokenizer

    path = str(bundled_model_path())
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    sample = AutoTokenizer.from_pretrained(path)(["an example", "a longer example sentence"],
                                                 padding=True, return_tensors="pt")
    target = folder / "minilm.onnx"
    axes = {name: {0: "batch", 1: "tokens"} for name in (*INPUTS, "last_hidden_state")}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shapes it keeps dynamic
        torch.onnx.export(LastHidden(model), tuple(sample[name] for name in INPUTS), str(target),
                          input_names=list(INPUTS), output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    return target, model.config


def graphs(folder: Path) -> dict[str, Path]:
    """The three graphs by variant name (see the module's docstring)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    plain, config = export(folder)
    fused = optimize_model(str(plain), model_type="bert", num_heads=config.num_attention_heads,
                           hidden_size=config.hidden_size)
    fused.save_model_to_file(str(folder / "fused.onnx"))
    quantize_dynamic(str(plain), str(folder / "int8.onnx"), weight_type=QuantType.QInt8)
    return {"fp32": plain, "fp32 fused": folder / "fused.onnx", "int8": folder / "int8.onnx"}


def session(path: Path, threads: int) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def mean_pooled(hidden: numpy.ndarray, mask: numpy.ndarray) -> numpy.ndarray:
    """Mean over the real tokens, L2 normalised: MiniLM's sentence embedding."""
    weights = mask[..., None].astype(hidden.dtype)
    pooled = (hidden * weights).sum(axis=1) / numpy.maximum(weights.sum(axis=1), 1e-9)
    norms: numpy.ndarray = numpy.linalg.norm(pooled, axis=1, keepdims=True)
    return pooled / numpy.maximum(norms, 1e-12)


def encoder(runner: Any, tokenizer: Any, batch_size: int) -> Any:
    """A configuration's encode: length-sorted batches of `batch_size`, rows in input order."""
    def encode(texts: Sequence[str]) -> numpy.ndarray:
        order = length_order(texts)
        rows = numpy.empty((len(texts), 0), dtype=numpy.float32)
        for start in range(0, len(order), batch_size):
            chosen = order[start:start + batch_size]
            tokens = tokenizer([texts[i] for i in chosen], padding=True, truncation=True,
                               max_length=MAX_SEQ_LENGTH, return_tensors="np")
            feed = {name: tokens[name].astype(numpy.int64) for name in INPUTS}
            embedded = mean_pooled(runner.run(None, feed)[0], feed["attention_mask"])
            if rows.shape[1] == 0:
                rows = numpy.empty((len(texts), embedded.shape[1]), dtype=numpy.float32)
            rows[chosen] = embedded
        return rows
    return encode


def systems(batch_sizes: Sequence[int], threads: int, folder: Path | None = None
            ) -> tuple[list[System], list[Skipped]]:
    """ONNX Runtime's variants, or why it is skipped (its package or onnx missing)."""
    why = missing("onnxruntime", "onnx")
    if why:
        return [], [Skipped("onnxruntime", "onnxruntime", why)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    folder = folder or Path(tempfile.mkdtemp(prefix="redbatch-peers-onnx-"))
    found = []
    for variant, path in graphs(folder).items():
        runner = session(path, threads)
        found.append(System(f"onnxruntime {variant}", "onnxruntime",
                            "int8" if variant == "int8" else "float32",
                            {f"batch {b}": encoder(runner, tokenizer, b) for b in batch_sizes},
                            note="ORT_ENABLE_ALL, intra_op threads = cores"))
    return found, [Skipped("onnxruntime bf16", "onnxruntime", BF16_WHY)]
