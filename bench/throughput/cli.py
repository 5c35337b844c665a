"""`python -m bench [--quick | --smoke] [--out DIR]`: run every measurement, write the report.

`python -m bench --generative [options]` runs the generative benchmark instead
(bench/generative/run.py; `--generative --help` lists its options)."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from bench.common.corpus import build_corpus
from bench.common.machine import describe_machine, machine_slug
from bench.common.paths import results_dir
from bench.common.stats import percentiles
from bench.throughput.measure import Benchmark, Layout
from bench.throughput.plan import PLANS
from bench.throughput.report import markdown, targets, write_json, write_plots
from worker.observe.log import configure_logging
from worker.streams.server import RedisServer

RESULTS_DIR = results_dir("throughput")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="plan",
                      help="a few hundred texts, fewer repeats (a minute or two)")
    size.add_argument("--smoke", action="store_const", const="smoke", dest="plan",
                      help="seconds long, for CI: exercises everything, measures nothing")
    parser.add_argument("--model", default=None,
                        help="model for the corpus measurements (default: minilm; smoke: echo)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument("--seed", type=int, default=0, help="corpus sample")
    return parser


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    plan = PLANS[args.plan or "full"]
    model = args.model or ("echo" if plan.name == "smoke" else "minilm")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench", *argv]),
        "plan": plan.__dict__, "machine": describe_machine(),
    }
    corpus = build_corpus(plan.corpus_size, args.seed, plan.corpus_files)
    with tempfile.TemporaryDirectory(prefix="redbatch-bench-") as data_dir, \
            RedisServer(Path(data_dir), appendonly=False) as server:
        bench = Benchmark(plan, server.url, corpus.texts, model, {}, Path(data_dir))
        lengths = bench.lengths()
        results["corpus"] = {
            "source": corpus.source, "files": corpus.files, "paragraphs": corpus.paragraphs,
            "unit": "tokens" if model == "minilm" else "bytes", "lengths": lengths,
            "length_percentiles": percentiles(lengths, (0, 25, 50, 75, 90, 99, 100)),
        }
        results["dtype"] = f"{bench.model.dtype}".removeprefix("torch.") + \
            f" ({bench.model.dtype_reason})"
        best = results["offline_configs"] = bench.best_offline()
        batch_size, layout = best["batch_size"], Layout(best["instances"], best["torch_threads"])
        with ExitStack() as stack:
            pools = bench.start_workers(stack, batch_size, layout)
            results["saturation"] = bench.saturation(pools, batch_size, layout)
            results["latency"] = bench.latency(pools["redbatch"],
                                               results["saturation"]["redbatch"]["median"])
            results["overhead"] = bench.overhead(pools["overhead"])
            results["scaling"] = bench.scaling(pools)
    results["load_average_end"] = [round(x, 2) for x in psutil.getloadavg()]
    results["seconds"] = time.perf_counter() - started
    results["targets"] = targets(results)
    return results


def summary(results: dict[str, Any]) -> str:
    saturation = results["saturation"]
    lines = [f"offline limit {saturation['offline']['median']:.1f} texts/s; one redbatch worker "
             f"{saturation['redbatch']['median']:.1f} texts/s "
             f"= {saturation['redbatch']['ratio_to_offline']:.2f} x offline "
             f"({len(results['corpus']['lengths'])} mixed-length texts)"]
    for target in results["targets"]:
        lines.append(f"{'MET ' if target['met'] else 'MISS'} {target['target']}: "
                     f"{target['value']:.2f} ({target['op']} {target['bar']:g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--generative"]:  # the generative part: its own options
        from bench.generative.run import main as generative

        return generative(argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging("info", "console")
    results = run(args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if results["plan"]["name"] == "full" else f"-{results['plan']['name']}"
    stem = args.out / f"{results['started'][:10]}-{machine_slug(results['machine'])}{suffix}"
    write_json(results, stem.with_suffix(".json"))
    plots = write_plots(results, stem)
    stem.with_suffix(".md").write_text(markdown(results, plots))
    print(summary(results))
    print(f"report: {stem.with_suffix('.md')}")
    return 0
