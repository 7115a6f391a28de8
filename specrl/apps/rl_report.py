"""The report of a `specrl rl` run: held-out reward per policy version, acceptance length over time
with its recovery after each policy swap, rollout tokens/s with and without speculation, and the
pipeline's stages side by side (generator rollouts/s, environment scores/s, trainer samples/s, and
the seconds each waited for another: `trainer.rollout.RolloutPipeline.stats`).

Acceptance recovery is computed from the server's /metrics counters, sampled during the run
(`specrl.apps.scrape.sample_metrics`: `tokens` = specrl_generation_tokens_total, `steps` =
specrl_verify_steps_total, `accepted` = vllm:spec_decode_num_accepted_tokens_total). The acceptance
of a stretch of samples is `specrl.speculation.quantities.tokens_per_step` over the summed counter deltas
(tokens per verify step, k = 0 steps included: what serving delivered, as on the live plot), so a
long window is not the mean of noisy per-sample ratios.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from specrl.speculation.quantities import tokens_per_step

TOLERANCE = 0.10  # "back within 10% of the pre-swap value"
STAGES = (("generator", "rollouts"), ("environment", "scores"), ("trainer", "samples"))


def acceptance_recovery(samples: list[dict], *, window_tokens: int, tolerance: float = TOLERANCE) -> list[dict]:
    """Per policy swap: acceptance length before it, right after it, and the rollout tokens it took
    to come back within `tolerance` of the value before.

    `samples`: /metrics samples in time order, each with `t`, `policy` and the counters `tokens`,
    `steps`, `accepted`; `eval: True` marks a sample whose interval since the previous one held only
    evaluation requests (rollouts paused), left out of every window. A swap is a change of `policy`
    between two consecutive samples; the interval between them (the swap itself) is left out too.

    - pre: the last >= `window_tokens` completion tokens before the swap (fewer if the previous swap
      is nearer; None when no verify step happened since it).
    - after: the first >= `window_tokens` tokens after the swap (fewer if the next swap comes first).
    - recovered at the first sample after the swap whose trailing window of >= `window_tokens`
      tokens (since the swap) has acceptance >= (1 - tolerance) * pre; `tokens_to_recover` counts
      the rollout tokens from the swap to that sample, so it is never below `window_tokens`, and
      its resolution is one sampling interval. Otherwise `recovered` is False, and `tokens_seen`
      says how many tokens were watched before the next swap or the end. None when pre is None.
    """
    segments, swaps = [[]], []  # counted intervals between swaps; (before, after) sample pairs
    for before, after in itertools.pairwise(samples):
        if before["policy"] != after["policy"]:
            swaps.append((before, after))
            segments.append([])
            continue
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("tokens", "steps", "accepted")}
        if not after.get("eval") and min(delta.values()) >= 0:  # a negative delta: the server restarted
            segments[-1].append({**delta, "t": after["t"]})
    results = []
    for (before, after), previous, following in zip(swaps, segments, segments[1:]):
        pre = _acceptance(_take_tokens(reversed(previous), window_tokens))
        result = {"t": after["t"], "from": before["policy"], "to": after["policy"], "pre": pre,
                  "after": _acceptance(_take_tokens(following, window_tokens)),
                  "tokens_seen": int(sum(i["tokens"] for i in following)), "recovered": None,
                  "tokens_to_recover": None, "t_recovered": None, "recovered_value": None}
        if pre is not None:
            result["recovered"] = False
            seen, window = 0.0, []
            for interval in following:
                seen += interval["tokens"]
                window.append(interval)
                while len(window) > 1 and sum(i["tokens"] for i in window[1:]) >= window_tokens:
                    window.pop(0)  # the shortest trailing window that still holds window_tokens
                value = _acceptance(window)
                if sum(i["tokens"] for i in window) >= window_tokens and value and value >= (1 - tolerance) * pre:
                    result.update(recovered=True, tokens_to_recover=int(seen), t_recovered=interval["t"],
                                  recovered_value=value)
                    break
        results.append(result)
    return results


def recovery_summary(swaps: list[dict], *, window_tokens: int, tolerance: float = TOLERANCE) -> dict:
    """The stated bound: every recovered swap came back within `max_tokens_to_recover` tokens."""
    recovered = [s["tokens_to_recover"] for s in swaps if s["recovered"]]
    return {"window_tokens": window_tokens, "tolerance": tolerance, "swaps": swaps, "recovered": len(recovered),
            "not_recovered": sum(1 for s in swaps if s["recovered"] is False),
            "unknown": sum(1 for s in swaps if s["recovered"] is None),
            "max_tokens_to_recover": max(recovered) if recovered else None}


def _take_tokens(intervals, window_tokens: int) -> list[dict]:
    """Intervals in the given order until they hold >= window_tokens tokens (or all of them)."""
    taken, tokens = [], 0.0
    for interval in intervals:
        if tokens >= window_tokens:
            break
        taken.append(interval)
        tokens += interval["tokens"]
    return taken


def _acceptance(intervals: list[dict]) -> float | None:
    return tokens_per_step(sum(i["accepted"] for i in intervals), sum(i["steps"] for i in intervals))


def write_report(run_dir: Path, report: dict) -> None:
    """rl-report.json, rl-report.png, and a short summary on stderr."""
    (run_dir / "rl-report.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(run_dir / "rl-report.png", report)
    for line in summary_lines(report):
        print(line, file=sys.stderr)
    print(f"specrl rl: report {run_dir / 'rl-report.json'} and {run_dir / 'rl-report.png'}", file=sys.stderr)


def summary_lines(report: dict) -> list[str]:
    recovery, speed = report.get("recovery") or {}, report.get("speed") or {}
    lines = []
    if recovery:
        lines.append(f"policy swaps: acceptance length before -> after, rollout tokens until back within "
                     f"{recovery['tolerance']:.0%} (windows of {recovery['window_tokens']} tokens)")
        for s in recovery["swaps"]:
            if s["recovered"]:
                outcome = f"recovered after {s['tokens_to_recover']:,} tokens"
            elif s["recovered"] is False:
                outcome = f"not recovered ({s['tokens_seen']:,} tokens watched)"
            else:
                outcome = "no acceptance data before the swap"
            lines.append(f"  t={s['t']:7.1f}s  {s['to']:>14}  {_fmt(s['pre'])} -> {_fmt(s['after'])}  {outcome}")
        bound = recovery["max_tokens_to_recover"]
        lines.append(f"  recovered {recovery['recovered']}/{len(recovery['swaps'])} swaps"
                     + (f", each within {bound:,} rollout tokens" if bound is not None else ""))
    tau = [e["serving_tau"] for e in _drafter_tau(report)]
    if tau:
        lines.append(f"drafter trainer: serving drafter's exact acceptance length (k=4, held-out records) "
                     f"{tau[0]:.2f} -> {tau[-1]:.2f} over {len(tau)} evaluations (min {min(tau):.2f}, max {max(tau):.2f})")
    if "ratio" in speed:
        on, off = speed["with_speculation"], speed["without_speculation"]
        lines.append(f"rollout tokens/s: {on['tokens_per_s']:.1f} with speculation, {off['tokens_per_s']:.1f} "
                     f"without: {speed['ratio']:.2f}x"
                     + (f" (median over rounds {speed['ratio_median']:.2f}x)" if speed.get("ratio_median") else "")
                     + f"  ({speed['tasks']} tasks x {speed['samples_per_task']} samples, "
                     f"{speed['rounds']} rounds, policy {speed['policy']})")
        if on.get("decode_seconds") and off.get("decode_seconds"):  # reports before the decode split lack it
            lines.append("  decode steps " + ", ".join(
                f"{arm['decode_seconds'] / arm['tokens'] * 1000:.2f} ms/token {name} ({arm['decode_seconds'] / arm['seconds']:.0%} "
                "of request time)" for name, arm in (("with", on), ("without", off))))
    elif "error" in speed:
        lines.append(f"rollout tokens/s with and without speculation: not measured ({speed['error']})")
    return lines + grpo_lines(report.get("steps") or []) + pipeline_lines(report.get("pipeline")) \
        + final_eval_lines(report.get("final_eval"))


def grpo_lines(steps: list[dict]) -> list[str]:
    """Reward per GRPO step and the share of flat groups (all rewards equal: no signal)."""
    if not steps:
        return []
    rewards = " ".join(f"{s['mean_reward']:.2f}" for s in steps[-40:])
    flat, groups = sum(s["flat_groups"] for s in steps), sum(s.get("groups", 0) for s in steps)
    lines = [f"GRPO: {len(steps)} steps, mean rollout reward per step{' (last 40)' if len(steps) > 40 else ''}: "
             f"{rewards}"]
    lines.append(f"  flat groups {flat} of {groups} ({flat / groups:.0%})" if groups else f"  flat groups {flat}")
    return lines


def final_eval_lines(final: dict | None) -> list[str]:
    """Base vs the last published policy on held-out tasks: each paired difference with its 95% CI."""
    if not final:
        return []
    if "skipped" in final:
        return [f"final evaluation skipped: {final['skipped']}"]
    lines = [f"final evaluation, {final['tasks']} held-out tasks, base -> {final['policy']} ({final['report']}):"]
    for name, entry, (low, high) in final_eval_rows(final):
        interval = f"[{low:+.3f}, {high:+.3f}]" if isinstance(entry["ci95"], list) else f"+- {entry['ci95']:.3f}"
        lines.append(f"  {name:<20} {entry['base']:.3f} -> {entry['trained']:.3f}  {entry['diff']:+.3f} "
                     f"{interval}" + (f"  p={entry['p_value']:.2g}" if "p_value" in entry else ""))
    return lines


def final_eval_rows(final: dict) -> list[tuple[str, dict, tuple[float, float]]]:
    """The final evaluation's paired metrics -> (name, entry, its 95% interval of trained - base): the CI is a
    [low, high] pair (IFEval's McNemar and bootstrap) or a +- half-width (the normal approximation)."""
    rows = []
    for name, entry in final.items():
        if isinstance(entry, dict) and "diff" in entry:
            ci = entry["ci95"]
            rows.append((name, entry, tuple(ci) if isinstance(ci, list) else (entry["diff"] - ci, entry["diff"] + ci)))
    return rows


def pipeline_lines(pipeline: dict | None) -> list[str]:
    """The stages side by side: count, rate, busy seconds, and seconds waited for each neighbour."""
    if not pipeline:
        return []
    lines = [f"pipeline over {pipeline['seconds']:.0f} s of training (environment seconds per worker):"]
    for stage, unit in STAGES:
        s = pipeline["stages"][stage]
        rate = s[f"{unit}_per_s"]
        waits = ", ".join(f"{seconds:.1f} s for the {other}" for other, seconds in s["waited_s"].items())
        extra = f" ({s['workers']} workers, {s['timeouts']} timeouts)" if stage == "environment" else ""
        lines.append(f"  {stage:<11} {s[unit]:6d} {unit:<8} {_fmt_rate(rate)}/s  busy {s['busy_s']:7.1f} s  "
                     f"waited {waits}{extra}")
    return lines


def _fmt_rate(rate: float | None) -> str:
    return "     -" if rate is None else f"{rate:6.2f}"


def _drafter_tau(report: dict) -> list[dict]:
    """The drafter trainer's evaluations that measured a serving drafter."""
    return [e for e in report.get("drafter_evaluations", []) if e["serving_tau"] is not None]


def _fmt(value: float | None) -> str:
    return "   -" if value is None else f"{value:4.2f}"


def _plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3, ax4, ax5) = plt.subplots(5, 1, figsize=(9, 13.5),
                                                  gridspec_kw={"height_ratios": [2, 2, 1, 1, 1.4]})
    evals = report["evals"]
    ax1.errorbar(range(len(evals)), [e["reward"] for e in evals], yerr=[e["ci95"] or 0 for e in evals], marker="o")
    ax1.set_xticks(range(len(evals)), [e["policy"] for e in evals], fontsize=7)
    ax1.set_ylabel(f"held-out reward ({report['env']})")
    shown = [s for s in report["samples"] if s.get("tokens_per_step") and not s.get("eval")]
    ax2.plot([s["t"] for s in shown], [s["tokens_per_step"] for s in shown], linewidth=1,
             label="served (live /metrics, rollouts; the controller's k)")
    recovery = report.get("recovery") or {"swaps": [], "tolerance": TOLERANCE}
    for swap in recovery["swaps"]:
        ax2.axvline(swap["t"], color="tab:red", linestyle="--", alpha=0.5)
        if swap["pre"] is not None:  # the threshold to get back to, from the swap to where it was reached
            end = swap["t_recovered"] or swap["t"]
            ax2.hlines((1 - recovery["tolerance"]) * swap["pre"], swap["t"], end, color="grey", linewidth=1)
        if swap["recovered"]:
            ax2.plot(swap["t_recovered"], swap["recovered_value"], "v", color="tab:green")
    tau = _drafter_tau(report)
    if tau:
        ax2.plot([e["t"] for e in tau], [e["serving_tau"] for e in tau], "o-", color="tab:orange", markersize=3,
                 label="serving drafter, exact k=4 on held-out records (drafter trainer)")
        ax2.legend(fontsize="x-small", loc="upper left")
    ax2.set_xlabel("seconds (dashed: policy swaps; green: acceptance back within "
                   f"{recovery['tolerance']:.0%} of its pre-swap value)")
    ax2.set_ylabel("acceptance length")
    speed = report.get("speed") or {}
    if "ratio" in speed:
        rates = [speed["with_speculation"]["tokens_per_s"], speed["without_speculation"]["tokens_per_s"]]
        ax3.bar_label(ax3.barh(["with speculation", "without"], rates, color=["tab:blue", "tab:grey"]), fmt="%.1f")
        ax3.set_title(f"rollout tokens/s on the final policy: {speed['ratio']:.2f}x with speculation", fontsize=9)
    else:
        ax3.set_title("rollout tokens/s: not measured", fontsize=9)
    ax3.set_xlabel("tokens/s")
    _plot_pipeline(ax4, report.get("pipeline"))
    _plot_final_eval(ax5, report.get("final_eval"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_final_eval(ax, final: dict | None) -> None:
    """Per metric, trained - base with its 95% CI on the held-out tasks; green where the CI lies above 0."""
    rows = final_eval_rows(final) if final and "skipped" not in final else []
    if not rows:
        ax.set_title("final evaluation: " + (final or {}).get("skipped", "not run"), fontsize=9)
        ax.set_axis_off()
        return
    for y, (name, entry, (low, high)) in enumerate(rows):
        color = "tab:green" if low > 0 else ("tab:red" if high < 0 else "tab:grey")
        ax.errorbar(entry["diff"], y, xerr=[[entry["diff"] - low], [high - entry["diff"]]], fmt="o", color=color,
                    capsize=3)
        ax.annotate(f"{entry['base']:.3f} -> {entry['trained']:.3f}", (high, y), xytext=(6, -3),
                    textcoords="offset points", fontsize=7)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [name for name, _, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{final['policy']} - base on {final['tasks']} held-out tasks, paired, 95% CI "
                  "(green: above 0)")
    ax.set_title(f"final evaluation: base -> {final['policy']}", fontsize=9)


def _plot_pipeline(ax, pipeline: dict | None) -> None:
    """One bar per stage: seconds busy, then seconds waited for each other stage, its rate as the label."""
    if not pipeline:
        ax.set_title("pipeline stages: not measured", fontsize=9)
        return
    colours = {"generator": "tab:blue", "environment": "tab:green", "trainer": "tab:purple"}
    names = [stage for stage, _ in STAGES]
    for row, (stage, unit) in enumerate(STAGES):
        s = pipeline["stages"][stage]
        ax.barh(row, s["busy_s"], color=colours[stage])
        left = s["busy_s"]
        for other, seconds in s["waited_s"].items():
            ax.barh(row, seconds, left=left, color=colours[other], alpha=0.35, hatch="//", edgecolor="white")
            left += seconds
        rate = s[f"{unit}_per_s"]
        ax.text(left, row, f"  {_fmt_rate(rate).strip()} {unit}/s", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel(f"seconds of {pipeline['seconds']:.0f} s training: solid busy, hatched waiting for the stage of "
                  "that colour (environment: per worker)", fontsize=8)
    ax.set_title("pipeline: generator rollouts/s, environment scores/s, trainer samples/s", fontsize=9)
