"""The exactness report (bench/generative/exactness.py): a difference, the summary, the markdown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.generative.continuous import Served

NEAR_TIE = 0.01  # a difference whose margins are both below this is float noise, not a bug
TOPK = 20  # reference logits kept per step, for the margin of the batched run's token


@dataclass(frozen=True, slots=True)
class Difference:
    id: str
    kind: str
    prompt_len: int
    max_new_tokens: int
    step: int  # the index of the first differing generated token
    reference_token: int
    batched_token: int
    reference_text: str
    batched_text: str
    reference_margin: float  # reference logits: its top-1 minus the batched run's token
    reference_margin_exact: bool  # false: that token was not in the top TOPK, a lower bound
    batched_margin: float | None  # batched logits: its top-1 minus the reference's token
    threshold: float  # a margin below this is a near-tie (near_tie_threshold)
    path: str  # how the batched run computed that step: "prefill" or "decode"
    width: int
    preempted: bool
    chunks: int
    preemptions: int

    @property
    def near_tie(self) -> bool:
        return (self.reference_margin < self.threshold
                and (self.batched_margin or 0.0) < self.threshold)


def markdown(report: Mapping[str, Any], differences: Sequence[Difference]) -> str:
    s, t, n = report["summary"], report["timings_s"], report["noise"]
    model = {"smollm2": "SmolLM2"}.get(report.get("model", "smollm2"), report.get("model"))
    lines = [f"# {model} continuous-batching exactness ({report['date']})", "",
             f"`{report['command']}`", "",
             f"- match: **{s['matched']}/{s['prompts']} = {100 * s['match_rate']:.1f}%** "
             + (f"(target >= 99%: {'met' if s['match_rate'] >= 0.99 else 'NOT met'})"
                if report.get("dtype", "float32") == "float32" else
                f"(in {report['dtype']} the target is no difference outside near-ties: "
                f"{'met' if s['differences'] == s['near_ties'] else 'NOT met'})"),
             f"- differences: {s['differences']} ({s['near_ties']} near-ties, both margins "
             f"< {report.get('near_tie_threshold', NEAR_TIE)}; "
             f"{s['differences'] - s['near_ties']} with a "
             "larger margin)",
             f"- {s['tokens']} tokens; {s['preemptions']} preemptions "
             f"({s['preempted_requests']} requests); {s['chunked_requests']} prompts "
             f"prefilled in > 1 chunk; widest decode batch {s['widest']}; {s['steps']} steps",
             f"- limits: {report['limits']}",
             f"- timings: load {t['load']:.1f}s, reference {t['reference']:.1f}s, "
             f"batched {t['batched']:.1f}s",
             f"- near-ties in the prompts themselves: {n['reference_top2_gap_below_near_tie']} "
             f"of {n['reference_steps']} reference steps have a top-2 gap < {NEAR_TIE} "
             f"(smallest {n['reference_top2_gap_min']:.2e})", "",
             "Top-1 logit drift, batched vs alone, where both chose the same token:", ""]
    for path, d in n["top1_drift"].items():
        lines.append(f"- {path}: {d['steps']} steps, median {d['median']:.2e}, "
                     f"max {d['max']:.2e}")
    if not differences:
        return "\n".join(lines + ["", "No differences."]) + "\n"
    lines += ["", f"Margins are top-1 minus the other run's token, in logits (+: a lower bound, "
              f"that token was not in the reference's top {TOPK}).",
              "", "| id | step | reference | batched | margin ref | margin batched | path "
              "| near-tie below | width | preempted |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in differences:
        ref_margin = f"{d.reference_margin:.2e}" + ("" if d.reference_margin_exact else "+")
        got = "n/a" if d.batched_margin is None else f"{d.batched_margin:.2e}"
        lines.append(f"| {d.id} | {d.step} | {d.reference_token} {d.reference_text!r} "
                     f"| {d.batched_token} {d.batched_text!r} | {ref_margin} | {got} "
                     f"| {d.path} | {d.threshold:.3g} | {d.width} | {d.preempted} |")
    return "\n".join(lines) + "\n"


def summary(rows: Sequence[Mapping[str, Any]], differences: Sequence[Difference],
            served: Served) -> dict[str, Any]:
    matched = sum(r["match"] for r in rows)
    return {"prompts": len(rows), "matched": matched, "match_rate": matched / len(rows),
            "differences": len(differences),
            "near_ties": sum(d.near_tie for d in differences),
            "tokens": sum(r["generated"] for r in rows),
            "preemptions": sum(r["preemptions"] for r in rows),
            "preempted_requests": sum(r["preemptions"] > 0 for r in rows),
            "chunked_requests": sum(r["chunks"] > 1 for r in rows),
            "widest": served.widest, "steps": served.steps}
