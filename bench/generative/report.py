"""The generative benchmark's memory check and its markdown report."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from bench.generative.online import RssPeak

MIB = 1 << 20
BASELINE = ("import transformers, torch, worker.app; from transformers import "
            "AutoModelForCausalLM; print(next(int(l.split()[1]) * 1024 for l in "
            "open('/proc/self/status') if l.startswith('VmRSS:')))")


def interpreter_rss() -> int:
    """What a worker process holds before its model: Python, torch, transformers."""
    return int(subprocess.run([sys.executable, "-c", BASELINE], check=True,
                              capture_output=True, text=True).stdout.split()[-1])


def memory_check(model: Any, kv_budget: int, rss: RssPeak) -> dict[str, Any]:
    """Peak RSS while serving against weights + KV budget (+ 10 %), on top of the
    interpreter's own; VmHWM includes the load (the GGUF is de-quantised then)."""
    lm = model.lm
    weights = sum(t.numel() * t.element_size() for t in [*lm.parameters(), *lm.buffers()])
    baseline = interpreter_rss()
    allowed = baseline + 1.1 * (weights + kv_budget)
    # the same bar counted from the loaded model (its tokenizer and loader included):
    # what serving adds may be the KV budget and 10 % of weights + KV
    growth, allowed_growth = rss.peak_bytes - rss.start_bytes, kv_budget + 0.1 * (
        weights + kv_budget)
    return {"weights_mib": weights / MIB, "kv_budget_mib": kv_budget / MIB,
            "interpreter_mib": baseline / MIB, "peak_serving_mib": rss.peak_bytes / MIB,
            "vm_hwm_mib": rss.field_bytes("VmHWM") / MIB, "allowed_mib": allowed / MIB,
            "met": rss.peak_bytes <= allowed, "loaded_mib": rss.start_bytes / MIB,
            "serving_growth_mib": growth / MIB, "allowed_growth_mib": allowed_growth / MIB,
            "growth_met": growth <= allowed_growth}


def _throughput_table(results: dict[str, Any]) -> list[str]:
    lines = ["| concurrency | redbatch (worker, Redis) | engine alone | static (finished rows "
             "leave) | static (HF generate) | generate_batch | redbatch / static | redbatch / "
             "HF static | redbatch / generate_batch |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cap, by in results["throughput"]["tokens_per_s"].items():
        m = {s: v["median"] for s, v in by.items()}
        lines.append(f"| {cap} | {m['redbatch']:.1f} | {m['engine']:.1f} | {m['static']:.1f} "
                     f"| {m['hf_static']:.1f} | {m['generate_batch']:.1f} | "
                     f"{m['redbatch'] / m['static']:.2f}x | "
                     f"{m['redbatch'] / m['hf_static']:.2f}x | "
                     f"{m['redbatch'] / m['generate_batch']:.2f}x |")
    return lines


def _throughput_lines(results: dict[str, Any]) -> list[str]:
    if "throughput" not in results:  # --ttft-only
        saturated = results["saturation"]
        return [f"Throughput not measured (--ttft-only); saturation {saturated['tokens_per_s']:.1f}"
                f" tokens/s = {saturated['requests_per_s']:.2f} req/s.", ""]
    return ["## Generated tokens/s (median over repeats)", "", *_throughput_table(results),
            "", f"Greedy agreement (largest concurrency, first repeat): "
            f"{results['throughput']['greedy_agreement']}.", ""]


def _ttft_lines(ttft: dict[str, Any]) -> list[str]:
    """Each loaded request beside the same prompt sent alone (bench/generative/ttft.py)."""
    alone = ttft["unloaded"]
    lines = ["| load | rate (req/s) | p50 ms | p95 ms | p95 / unloaded p50 | "
             "p95 / unloaded p95 | slowdown p50 | slowdown p95 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             f"| unloaded (each alone) | - | {alone['p50']:.0f} | {alone['p95']:.0f} | - | - "
             f"| - | - |"]
    for load in ("50%", "80%"):
        row = ttft[load]
        lines.append(f"| {load} of saturation | {row['rate_rps']:.2f} | {row['p50']:.0f} | "
                     f"{row['p95']:.0f} | {row['p95_over_unloaded_p50']:.2f}x | "
                     f"{row['p95_over_unloaded_p95']:.2f}x | {row['slowdown_p50']:.2f}x | "
                     f"{row['slowdown_p95']:.2f}x |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    memory = results["memory"]
    lines = [f"# Generative benchmark: {results['model']}", "",
             f"`{results['command']}`, started {results['started']}, "
             f"{results['threads']} torch threads everywhere, "
             f"{results.get('workers', 1)} redbatch worker process(es).", "",
             f"Workload: {results['workload']}.", "",
             *_throughput_lines(results),
             "## Time to first token (XADD to the first sampled token)", "",
             *_ttft_lines(results["ttft_ms"]), "", "## Memory", "",
             f"Peak RSS of the first worker while serving {memory['peak_serving_mib']:.0f} "
             f"MiB (VmHWM with the load: {memory['vm_hwm_mib']:.0f} MiB) against interpreter "
             f"{memory['interpreter_mib']:.0f} + 1.1 x (weights {memory['weights_mib']:.0f} + "
             f"KV budget {memory['kv_budget_mib']:.0f}) = {memory['allowed_mib']:.0f} MiB: "
             f"{'met' if memory['met'] else 'NOT met'}. Counted from the loaded worker "
             f"({memory['loaded_mib']:.0f} MiB: interpreter, tokenizer, weights), serving "
             f"added {memory['serving_growth_mib']:.0f} MiB against KV budget + 10 % of "
             f"weights + KV = {memory['allowed_growth_mib']:.0f} MiB: "
             f"{'met' if memory['growth_met'] else 'NOT met'}.", ""]
    if "constrained_mix" in results:
        lines += _constrained_lines(results["constrained_mix"])
    return "\n".join(lines)


def _constrained_lines(mix: dict[str, Any]) -> list[str]:
    """bench/generative/constrained.py's table: half the requests under a JSON schema."""
    lines = ["## Constrained mix (engine in process; odd requests under a JSON schema)", "",
             "| concurrency | unconstrained tok/s | mixed tok/s | ratio | mask ms / masked "
             "step | valid / constrained (cut by length) |", "|---|---|---|---|---|---|"]
    for cap, run in mix.items():
        if cap == "schema":
            continue
        mixed = run["mixed"]
        lines.append(f"| {cap} | {run['unconstrained']['tokens_per_s']} | "
                     f"{mixed['tokens_per_s']} | {run['ratio']} | "
                     f"{mixed['mask_ms_per_masked_step']} | {mixed['valid']} / "
                     f"{mixed['constrained']} ({mixed['cut_by_length']}) |")
    return [*lines, ""]
