"""The report: targets checked, a JSON of every figure, and Markdown with PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

THROUGHPUT_CONFIGS = ("offline", "redbatch", "fifo", "batch1")
LABELS = {"offline": "offline limit\n(in-process, sorted)", "redbatch": "redbatch\n(buckets)",
          "fifo": "FIFO batching\n(no buckets)", "batch1": "batch size 1"}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 5: the measured value, the bar, and whether it was met."""
    saturation, overhead = results["saturation"], results["overhead"]
    checks = [
        ("redbatch end to end / offline limit", saturation["redbatch"]["ratio_to_offline"],
         ">=", 0.90),
        ("bucketing / FIFO batching, same max_batch_size",
         saturation["fifo"]["bucketing_speedup"], ">=", 1.5),
        ("echo requests/s, one worker process", overhead["worker_median"], ">=", 20_000),
        ("echo worker / Redis's own rate, same commands", overhead["ratio"], ">=", 0.5),
    ]
    if "defaults" in saturation:  # runs before this one measured no default pool
        checks.append(("default settings (instances auto) / the best layout measured",
                       saturation["defaults"]["ratio_to_best_layout"], ">=", 0.9))
    half = [level for level in results["latency"]["levels"] if level["load"] == 0.5]
    if half:
        wait = results["latency"]["settings"]["max_wait_ms"]
        bound = wait + 2 * half[0]["batch_compute_ms"]["p99"]
        checks.append((f"p99 end to end at 50 % load, ms (bound: max_wait_ms {wait:g} + "
                       "2 x p99 batch compute)", half[0]["e2e_ms"]["p99"], "<=", bound))
    processes = results["scaling"]["processes"]
    for count, bar in ((2, 1.8), (4, 3.2)):
        if count in processes:
            checks.append((f"scaling, {count} processes / 1 (echo, delay_ms)",
                           processes[count]["factor"], ">=", bar))
    return [{"target": name, "value": value, "bar": bar, "met": value >= bar if op == ">="
             else value <= bar, "op": op} for name, value, op, bar in checks]


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def plot_throughput(saturation: dict[str, Any], path: Path) -> None:
    values = [saturation[c]["median"] for c in THROUGHPUT_CONFIGS]
    figure, axes = plt.subplots(figsize=(7, 4))
    bars = axes.bar([LABELS[c] for c in THROUGHPUT_CONFIGS], values,
                    color=["grey", "tab:blue", "tab:orange", "tab:red"])
    axes.bar_label(bars, fmt="%.0f")
    axes.set_ylabel("texts/s (median)")
    axes.set_title("Throughput on the corpus at saturation")
    save(figure, path)


def plot_latency(latency: dict[str, Any], path: Path) -> None:
    levels = latency["levels"]
    loads = [100 * level["load"] for level in levels]
    figure, axes = plt.subplots(figsize=(7, 4))
    for q, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^-")):
        axes.plot(loads, [level["e2e_ms"][q] for level in levels], style, label=f"end to end {q}")
    axes.plot(loads, [level["queue_ms"]["p99"] for level in levels], "^--",
              label="queue wait p99")
    axes.set_xlabel("load, % of saturated throughput (Poisson arrivals)")
    axes.set_ylabel("ms")
    axes.set_title("Latency against load")
    axes.legend()
    save(figure, path)


def plot_histograms(saturation: dict[str, Any], key: str, title: str, xlabel: str,
                    path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    configs = ("redbatch", "fifo")
    width = 0.4
    bins = sorted({float(le) for c in configs for le in saturation[c][key]})
    for offset, config in enumerate(configs):
        counts = {float(le): n for le, n in saturation[config][key].items()}
        total = sum(counts.values()) or 1
        axes.bar([i + offset * width for i in range(len(bins))],
                 [counts.get(b, 0) / total for b in bins], width, label=config)
    axes.set_xticks([i + width / 2 for i in range(len(bins))],
                    [f"≤{b:g}" for b in bins], rotation=45)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("share of batches")
    axes.set_title(title)
    axes.legend()
    save(figure, path)


def plot_scaling(scaling: dict[str, Any], path: Path) -> None:
    counts = sorted(scaling["processes"])
    figure, axes = plt.subplots(figsize=(5, 4))
    axes.plot(counts, [scaling["processes"][n]["factor"] for n in counts], "o-",
              label="measured")
    axes.plot(counts, counts, ":", color="grey", label="linear")
    axes.set_xlabel("worker processes")
    axes.set_ylabel("throughput / one process")
    axes.set_title("Scaling (echo with delay_ms)")
    axes.legend()
    save(figure, path)


def save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_plots(results: dict[str, Any], stem: Path) -> dict[str, str]:
    """The PNGs beside the report; returns their file names by subject."""
    saturation = results["saturation"]
    plots = {
        "throughput": lambda p: plot_throughput(saturation, p),
        "latency": lambda p: plot_latency(results["latency"], p),
        "batch-sizes": lambda p: plot_histograms(
            saturation, "batch_size_histogram", "Batch sizes formed", "requests per batch", p),
        "padding": lambda p: plot_histograms(
            saturation, "padding_efficiency_histogram", "Padding efficiency per batch",
            "real / padded tokens", p),
        "scaling": lambda p: plot_scaling(results["scaling"], p),
    }
    names = {}
    for subject, plot in plots.items():
        path = stem.with_name(f"{stem.name}-{subject}.png")
        plot(path)
        names[subject] = path.name
    return names


def markdown(results: dict[str, Any], plots: dict[str, str]) -> str:
    """The human report: what ran where, the table of figures, the targets, the plots."""
    sections = (_header(results), _saturation(results, plots), _latency(results, plots),
                _overhead(results), _scaling(results, plots), _targets(results))
    return "\n".join(line for section in sections for line in section) + "\n"


def _header(results: dict[str, Any]) -> list[str]:
    """What ran, where, and on which texts."""
    machine, corpus, plan = results["machine"], results["corpus"], results["plan"]
    return [
        f"# redbatch benchmark — {results['started'][:10]}, {plan['name']} run",
        "",
        f"Command: `{results['command']}` (git {machine['git_commit']}), "
        f"{results['seconds']:.0f} s. Every figure is the median of {plan['repeats']} "
        "repeats taken side by side (interleaved); ratios are medians of per-repeat ratios.",
        "",
        "## Machine",
        "",
        f"- {machine['cpus']} CPUs ({machine['cpu']}), {machine['memory_gib']} GiB, "
        f"{machine['os']}",
        f"- Python {machine['python']}, torch {machine['torch']} "
        f"(default {machine['torch_threads']} threads), "
        f"{machine['redis_server'].split(' sha=')[0]} (embedded, AOF off)",
        f"- the model in {results.get('dtype', 'float32')}, offline and in the workers",
        f"- load average at start {machine['load_average']}, at end "
        f"{results['load_average_end']}" + (" — **shared, loaded machine: figures are noisy**"
                                           if max(machine["load_average"][0],
                                                  results["load_average_end"][0]) >= 1 else ""),
        "",
        "## Corpus",
        "",
        f"{len(corpus['lengths'])} texts: {corpus['source']}; {corpus['paragraphs']} distinct "
        f"paragraphs in {corpus['files']} files. Length in {corpus['unit']}: "
        + ", ".join(f"{k} {v:.0f}" for k, v in corpus["length_percentiles"].items()) + ".",
        "",
    ]


def _saturation(results: dict[str, Any], plots: dict[str, str]) -> list[str]:
    """Throughput with the whole corpus queued, against the offline limit."""
    saturation = results["saturation"]
    lines = [
        "## Throughput at saturation (whole corpus queued, time to the last reply)",
        "",
        "| configuration | settings | texts/s | × offline | padding efficiency |",
        "|---|---|---:|---:|---:|",
        "| (1) offline limit: in-process, length-sorted | batch "
        f"{saturation['offline']['batch_size']}, {saturation['offline']['instances']} "
        f"instance(s) x {saturation['offline']['torch_threads']} torch thread(s) | "
        f"{saturation['offline']['median']:.1f} | 1.00 | — |",
    ]
    for name, label in (("redbatch", "(2) redbatch, length buckets"),
                        ("fifo", "(3) FIFO batching (`bucket_boundaries = []`)"),
                        ("batch1", "(3) batch size 1"),
                        ("defaults", "(2) redbatch, default settings")):
        row = saturation[name]
        settings = {k: v for k, v in row["settings"].items() if k not in ("model_options",)}
        lines.append(f"| {label} | {settings} | {row['median']:.1f} | "
                     f"{row['ratio_to_offline']:.2f} | {row['padding_efficiency']:.2f} |")
    lines += [
        "",
        f"Bucketing vs FIFO: ×{saturation['fifo']['bucketing_speedup']:.2f}; "
        f"vs batch size 1: ×{saturation['batch1']['bucketing_speedup']:.2f}. The offline "
        f"configuration was chosen on {results['offline_configs']['texts']} texts: "
        + ", ".join(f"{k}: {v:.1f}" for k, v in results["offline_configs"]["rates"].items())
        + " texts/s. The workers use the same batch size, instances and torch thread count. "
        f"`merge_tokens` measured at warm-up by the bucketed worker: "
        f"{saturation['redbatch'].get('merge_tokens')}.",
        "",
        f"![throughput]({plots['throughput']}) ![batch sizes]({plots['batch-sizes']}) "
        f"![padding]({plots['padding']})",
        "",
    ]
    return lines


def _latency(results: dict[str, Any], plots: dict[str, str]) -> list[str]:
    """Percentiles under open-loop Poisson arrivals, per load level."""
    latency = results["latency"]
    lines = [
        "## Latency under open-loop Poisson arrivals",
        "",
        f"Settings {latency['settings']}; {latency['seconds_per_level']:g} s of arrivals per "
        "level. Queue wait: from XADD to the start of the request's batch. Model busy: the "
        "batches' compute time over the level's duration, per model instance.",
        "",
        "| load | req/s | e2e p50 | e2e p95 | e2e p99 | queue p50 | queue p95 | queue p99 | "
        "batch compute p99 | batch size mean | model busy |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in latency["levels"]:
        e2e, queue = level["e2e_ms"], level["queue_ms"]
        lines.append(f"| {100 * level['load']:.0f} % | {level['rate']:.1f} | {e2e['p50']:.1f} | "
                     f"{e2e['p95']:.1f} | {e2e['p99']:.1f} | {queue['p50']:.1f} | "
                     f"{queue['p95']:.1f} | {queue['p99']:.1f} | "
                     f"{level['batch_compute_ms']['p99']:.1f} | {level['mean_batch_size']:.2f} | "
                     f"{100 * level['busy']:.0f} % |")
    lines += [
        "",
        "Times in ms. " + f"![latency]({plots['latency']})",
        "",
    ]
    return lines


def _overhead(results: dict[str, Any]) -> list[str]:
    """One echo worker process against Redis's own rate for the same commands."""
    overhead = results["overhead"]
    return [
        "## Overhead: echo (no delay) through one worker process vs Redis itself",
        "",
        f"{overhead['requests']} requests queued at once; worker settings "
        f"{overhead['settings']}. Redis's own rate: the same commands per request (XREADGROUP "
        f"COUNT {overhead['settings'].get('read_count', 256)} as the worker reads, then the "
        "worker's own reply script: one XPENDING for ownership, LPUSH and "
        "PEXPIRE per reply, one XACK) issued by a bare loop with the worker's own reader and "
        "replier, nothing else. Medians of "
        f"{len(overhead['worker_rates'])} repeats, worker and Redis loop interleaved.",
        "",
        "| | requests/s |",
        "|---|---:|",
        f"| (5) one worker process, echo | {overhead['worker_median']:.0f} |",
        f"| Redis's own rate, same commands | {overhead['redis_serve_median']:.0f} |",
        f"| worker / Redis | {overhead['ratio']:.2f} |",
        f"| (XADD, pipelined, for reference) | {overhead['redis_xadd_median']:.0f} |",
        "",
        f"Redis server CPU per request (INFO commandstats, all commands): "
        f"{overhead['redis_server_us_per_request']:.1f} µs.",
        "",
    ]


def _scaling(results: dict[str, Any], plots: dict[str, str]) -> list[str]:
    """Requests/s as worker processes are added."""
    scaling = results["scaling"]
    lines = [
        "## Scaling worker processes (echo, `delay_ms` standing in for device time)",
        "",
        f"Settings {scaling['settings']}.",
        "",
        "| processes | requests/s | × one process |",
        "|---:|---:|---:|",
    ]
    for count, row in sorted(scaling["processes"].items()):
        lines.append(f"| {count} | {row['median']:.0f} | {row['factor']:.2f} |")
    return [*lines, "", f"![scaling]({plots['scaling']})"]


def _targets(results: dict[str, Any]) -> list[str]:
    """Each target of the throughput issue, met or not."""
    lines = ["", "## Targets (issue 5)", "", "| target | measured | bar | met |",
             "|---|---:|---:|:-:|"]
    for target in results["targets"]:
        lines.append(f"| {target['target']} | {target['value']:.2f} | {target['op']} "
                     f"{target['bar']:g} | {'yes' if target['met'] else '**no**'} |")
    return lines
