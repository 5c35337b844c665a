"""`python -m bench.peers`: redbatch at default settings against its peers on this CPU.

One run, one corpus (bench/common/corpus.py), every system side by side: redbatch served (one
default worker process through Redis), redbatch's offline limit in the same dtype, ONNX
Runtime (fp32, fused fp32, int8) and sentence-transformers (fp32, bf16); infinity when
installed. Each system's fastest configuration (batch 32/64/128, redbatch offline's layouts
too) is chosen on the first --select-texts texts, then the systems take turns over --repeats
rounds of the whole corpus (the order rotating each round), and medians and the paired
ratios are reported. A peer whose package is missing is reported as skipped, with why.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from bench.common.corpus import build_corpus
from bench.common.machine import describe_machine, machine_slug, usable_cpus
from bench.common.paths import results_dir
from bench.peers import onnx, redbatch, st
from bench.peers.report import summarise, write
from bench.peers.systems import Skipped, System, compare, missing

#: the float32 references for the accuracy check, the first one that ran
REFERENCES = ("sentence-transformers float32", "onnxruntime fp32")
ACCURACY_TEXTS = 256
PEERS = ("onnxruntime", "sentence-transformers", "infinity")
INFINITY_WHY = ("did not install: infinity-emb 0.0.78 (the latest) requires numpy<2, and its "
                "torch engine sentence-transformers<4 and transformers<=5.0; installing it would "
                "downgrade them under everything else")
INFINITY_NO_RUNNER = "installed, but not measured: no runner for it here yet"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=4000, help="corpus size (texts)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each system once")
    parser.add_argument("--select-texts", type=int, default=500,
                        help="texts each configuration is timed on to pick a system's best")
    parser.add_argument("--batch-sizes", default="32,64,128", help="tried by every system")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated, of {', '.join(PEERS)}; 'none' for redbatch only")
    parser.add_argument("--seed", type=int, default=0, help="corpus sample")
    parser.add_argument("--corpus-files", type=int, default=None,
                        help="standard library files the corpus is sampled from (default all; "
                             "a smoke run reads fewer, in less time)")
    parser.add_argument("--out", type=Path, default=results_dir("peers"), help="results folder")
    return parser


def say(line: str) -> None:
    print(line, flush=True)


def peer_systems(peers: list[str], batch_sizes: list[int], cores: int, folder: Path
                 ) -> tuple[list[System], list[Skipped]]:
    systems: list[System] = []
    skipped: list[Skipped] = []
    for peer in peers:
        say(f"loading {peer} ...")
        if peer == "onnxruntime":
            found = onnx.systems(batch_sizes, cores, folder)
        elif peer == "sentence-transformers":
            found = st.systems(batch_sizes, cores)
        else:  # infinity: no runner here until it installs beside this torch and numpy
            found = [], [Skipped("infinity", "infinity", INFINITY_WHY
                                 if missing("infinity_emb") else INFINITY_NO_RUNNER)]
        systems += found[0]
        skipped += found[1]
    for skip in skipped:
        say(f"{skip.name}: {skip.reason}")
    return systems, skipped


def check_accuracy(systems: list[System], texts: list[str]) -> str | None:
    """Each peer's lowest cosine to a float32 peer (its embeddings are what is compared, not
    only its speed: int8 and bf16 trade accuracy); the reference's name (None: none ran)."""
    reference = next((s for name in REFERENCES for s in systems if s.name == name), None)
    if reference is None:
        return None
    compare(systems, reference, texts)
    for system in systems:
        if system.min_cosine is not None:
            say(f"{system.name}: min cosine {system.min_cosine:.5f} to {reference.name}")
    return reference.name


def rounds(systems: list[System], texts: list[str], repeats: int) -> None:
    """Every system once a round, the starting system rotating, so none always goes first."""
    for round_ in range(repeats):
        turn = round_ % len(systems)
        for system in systems[turn:] + systems[:turn]:
            rate = system.measure(texts)
            say(f"round {round_ + 1}/{repeats}: {system.name:32} {rate:9.1f} texts/s")


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(sorted(unknown))}; of {', '.join(PEERS)}")
    cores = usable_cpus()
    corpus = build_corpus(args.texts, args.seed, args.corpus_files)
    with ExitStack() as stack:
        workers = redbatch.start_worker(stack, folder)  # starts while the others load
        say("loading redbatch offline ...")
        systems = redbatch.offline(batch_sizes, cores)
        found, skipped = peer_systems(peers, batch_sizes, cores, folder)
        systems = [redbatch.served(workers), *systems, *found]
        for system in systems:
            chosen = system.choose(corpus.texts[:args.select_texts])
            say(f"{system.name} ({system.dtype}): {chosen}; tried "
                + ", ".join(f"{d} {r:.0f}" for d, r in system.selection.items()))
        reference = check_accuracy(systems, corpus.texts[:ACCURACY_TEXTS])
        rounds(systems, corpus.texts, args.repeats)
    return {"accuracy_reference": reference,
            "accuracy_texts": min(ACCURACY_TEXTS, len(corpus.texts)),
            "texts": len(corpus.texts), "corpus": corpus.source, "repeats": args.repeats,
            "select_texts": args.select_texts, "batch_sizes": batch_sizes, "peers": peers,
            **summarise(systems, skipped)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.peers", *argv]),
        "machine": describe_machine()}
    say(f"{report['machine']['cpu']}, {report['machine']['cpus']} cores, flags "
        f"{' '.join(report['machine']['cpu_flags'])}")
    with tempfile.TemporaryDirectory(prefix="redbatch-peers-") as folder:
        report.update(measure(args, Path(folder)))
    report["load_average_end"] = [round(x, 2) for x in psutil.getloadavg()]
    report["seconds"] = time.perf_counter() - started
    stem = args.out / f"{report['started'][:10]}-{machine_slug(report['machine'])}"
    data, table = write(report, stem)
    say(table.read_text())
    say(f"report: {data}, {table}")
    return 0
