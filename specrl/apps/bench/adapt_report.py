"""The report half of `specrl bench adapt`: what the trainer did (its log and manifests,
throughput, lag from a request's completion to a published drafter that learned from it), the
JSON result, the printed table and the chart. `specrl.apps.bench.adapt` runs the measurement and
hands its raw runs here; how each number is measured is written there."""

from __future__ import annotations

import math
import sys
from bisect import bisect_left
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

from specrl.apps.bench import cpu_use
from specrl.apps.bench.backends import machine_line, settings_record
from specrl.config import Settings
from specrl.telemetry.event_log import read_events

# ---- the trainer's side: log, manifests, throughput, lag -------------------------------------
def trainer_report(events_path: Path, clock: Callable[[float], float], store, run: dict, samples_every: int) -> dict:
    """`run`'s raw arrivals and polls -> throughput, lag, evaluations, publishes, rollbacks;
    `clock` maps wall time to traffic seconds, every `samples_every`-th poll is kept as the backlog curve."""
    end = run.pop("final_pause_wall")
    arrivals, polls = run.pop("arrivals"), run.pop("polls")
    events = [e for e in read_events(events_path, "evaluate", "publish", "rollback") if e["time"] <= end]
    for e in events:
        e["traffic_s"] = clock(e["time"])
    manifests = {m.version: m for m in store.versions("drafter")} if store.root.is_dir() else {}
    publishes = [e for e in events if e["event"] == "publish"]
    for p in publishes:
        m = manifests.get(p["version"])
        p["created"] = m.created if m else None
        p["records"] = m.metrics.get("records") if m else None
    evaluations = [e for e in events if e["event"] == "evaluate"]
    span = clock(end)
    trained = int(evaluations[-1]["records"]) if evaluations else 0
    delivered = sum(1 for a in arrivals if polls and a <= polls[-1][1])
    throughput = {"trained_records": trained,
                  "trained_records_per_s": trained / max(evaluations[-1]["traffic_s"], 1e-9) if trained else 0.0,
                  "stream_records": len(arrivals), "stream_records_per_s": len(arrivals) / span if span else 0.0,
                  "delivered_records": delivered, "delivered_records_per_s": delivered / span if span else 0.0,
                  "backlog_at_end": len(arrivals) - delivered, "traffic_s": span}
    backlog = [[round(clock(t), 1), lag] for t, _, lag in polls[::samples_every]]
    return {"evaluations": evaluations, "publishes": publishes, "backlog": backlog,
            "rollbacks": [e for e in events if e["event"] == "rollback"],
            "manifests": [m.to_dict() for m in manifests.values()], "throughput": throughput,
            "lag": lag(arrivals, polls, [p["time"] for p in publishes], clock, end)}


def lag(arrivals: list[tuple[int, int]], polls: list, publishes: list[float], clock: Callable[[float], float],
        end: float) -> dict:
    """Per record: traffic seconds from its arrival to the first publish after a poll saw it delivered."""
    lags, freshest, pending, j = [], {}, 0, 0
    for entry in sorted(arrivals):
        while j < len(polls) and polls[j][1] < entry:
            j += 1
        k = bisect_left(publishes, polls[j][0]) if j < len(polls) else len(publishes)
        if k == len(publishes):
            pending += 1
            continue
        lag = clock(publishes[k]) - clock(entry[0] / 1000)
        lags.append(lag)
        freshest[k] = min(freshest.get(k, math.inf), lag)
    lags.sort()
    stats = {"records": len(arrivals), "in_a_publish": len(lags), "not_yet_published": pending,
             "method": "stream entry id -> first group poll showing it delivered -> next event=publish; traffic clock"}
    if lags:
        stats.update(median_s=lags[len(lags) // 2], p90_s=lags[min(len(lags) - 1, int(0.9 * len(lags)))],
                     min_s=lags[0], mean_s=sum(lags) / len(lags),
                     freshest_per_publish_s=[freshest[k] for k in sorted(freshest)])
    return stats


# ---- report -----------------------------------------------------------------------------------
def build_result(settings: Settings, minutes: float, objectives: list[str], shift: bool, users: int, runs: list[dict],
                 redis_external: bool, measurement: dict, child_threads: int, machine: dict,
                 llamacpp: dict | None = None) -> dict:
    """The whole report: environment, settings, the measurement plan, per-run summary and raw runs; with
    `llamacpp` (its rows on the held-out prompts), each run's last checkpoint over llama.cpp's best."""
    import transformers

    summary = {}
    for run in runs:
        first, last = run["checkpoints"][0], run["checkpoints"][-1]
        online = last["drafters"]["online"]
        entry = {"mean_acceptance_length_k4": [first["drafters"]["online"]["mean_acceptance_length_k4"],
                                          online["mean_acceptance_length_k4"]],
                 "ratio_b1": [first["drafters"]["online"]["ratio_b1"], online["ratio_b1"]],
                 "ratio_b4": [first["drafters"]["online"].get("ratio_b4"), online.get("ratio_b4")],
                 "ratio_b4_median": [first["drafters"]["online"].get("ratio_b4_median"), online.get("ratio_b4_median")],
                 "proposers": {name: {"ratio_b1": [first["drafters"][name]["ratio_b1"], last["drafters"][name]["ratio_b1"]],
                                      "ratio_b4": [first["drafters"][name].get("ratio_b4"),
                                                   last["drafters"][name].get("ratio_b4")],
                                      "ratio_b4_median": [first["drafters"][name].get("ratio_b4_median"),
                                                          last["drafters"][name].get("ratio_b4_median")],
                                      "tokens_per_step_b1": [first["drafters"][name]["b1"]["tokens_per_step"],
                                                             last["drafters"][name]["b1"]["tokens_per_step"]]}
                               for name in CONFIGURATIONS if name in last["drafters"]},
                 "publishes": len(run["publishes"]), "trained_records_per_s": run["throughput"]["trained_records_per_s"],
                 "lag_median_s": run["lag"].get("median_s"),
                 "token_yield": next((s["yield"] for s in reversed(run["served"]) if s.get("yield")), None)}
        if "frozen" in last["drafters"]:
            frozen = last["drafters"]["frozen"]
            entry["online_over_frozen_b1"] = online["b1"]["tokens_per_s"] / frozen["b1"]["tokens_per_s"]
            entry["online_over_frozen_b4"] = (online["b4"]["tokens_per_s"] / frozen["b4"]["tokens_per_s"]
                                              if "b4" in online else None)
            entry["frozen_version"] = frozen["version"]
        if llamacpp:
            entry["over_llamacpp_best"] = over_llamacpp_best(last, llamacpp["rows"])
        summary[run["name"]] = entry
    extra = {"llamacpp": llamacpp} if llamacpp else {}
    return {
        "command": sys.argv, "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "child_threads": child_threads, "model": settings.model, "machine": machine,
        "settings": settings_record(settings),
        "minutes": minutes, "objectives": objectives, "shift": shift, "users": users,
        "redis": "REDIS_URL" if redis_external else "embedded valkey",
        "measurement": measurement,
        "summary": summary, "runs": runs, **extra,
    }


def llamacpp_best(rows: list[dict], key: str) -> dict | None:
    """llama.cpp's fastest row (end-to-end tokens/s: its prompt and its generation) at B = 1 ("b1") or 4 ("b4")."""
    at = [r for r in rows if r["batch_size"] == int(key[1:])]
    return max(at, key=lambda r: r["tokens_per_s"]) if at else None


def over_llamacpp_best(checkpoint: dict, rows: list[dict]) -> dict:
    """-> {"b1"/"b4": {"llamacpp": its best row's engine, "plain": ratio, configuration: ratio}}: a checkpoint's
    end-to-end tokens/s (prompt included, as llama.cpp's) over llama.cpp's best at the same B."""
    out = {}
    for key in ("b1", "b4"):
        best = llamacpp_best(rows, key)
        if best is None or key not in checkpoint["plain"]:
            continue
        ours = {"plain": checkpoint["plain"][key], **{n: d[key] for n, d in checkpoint["drafters"].items() if key in d}}
        out[key] = {"llamacpp": best["engine"], "llamacpp_tokens_per_s": best["tokens_per_s"],
                    **{name: speed["tokens_per_s"] / best["tokens_per_s"] for name, speed in ours.items()}}
    return out


CONFIGURATIONS = {"online": "head", "online+suffix": "hybrid", "suffix": "suffix index"}  # measured beside plain


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_table(result: dict) -> None:
    shifted_to = result["measurement"]["shift_domains"][1]
    for when, machine in result["machine"].items():
        print(f"machine ({when}): {machine_line(machine)}")
    print(f"{'run':<12} {'point':<8} {'min':>5} {'tokens':>7} {'trained':>7} {'drafter':>7} {'(recs)':>6} {'acc.k4':>6} "
          f"{'spec':>6} {'plain':>6} {'B1 x':>5} {'med x':>5} {'B4 x':>5} {'med x':>5}")
    for run in result["runs"]:
        for c in run["checkpoints"]:
            for label, d in c["drafters"].items():
                name = run["name"] + ("" if label == "online" else f" ({label})")
                print(f"{name:<12} {c['label']:<8} {c['traffic_s'] / 60:>5.1f} {c['traffic_tokens']:>7} "
                      f"{c['trainer_records']:>7} {d['version']:>7} {c['drafter_records'] if label == 'online' else '-':>6} "
                      f"{fmt(d.get('mean_acceptance_length_k4')):>6} "
                      f"{d['b1']['tokens_per_s']:>6.1f} {c['plain']['b1']['tokens_per_s']:>6.1f} "
                      f"{d['ratio_b1']:>5.2f} {d['ratio_b1_median']:>5.2f} {fmt(d.get('ratio_b4')):>5} "
                      f"{fmt(d.get('ratio_b4_median')):>5}")
    for run in result["runs"]:
        for c in run["checkpoints"]:
            if "cpu" in c:  # reports written before 2026-12-04 lack it
                print(f"{run['name']} {c['label']}: {cpu_use.describe(c['cpu'])}")
    if "llamacpp" in result:
        beside = result["llamacpp"]
        print(f"llama.cpp {beside['version']} on the held-out prompts' mean length ({beside['prompt_tokens']} tokens, "
              f"{beside['new_tokens']} new), after the runs:")
        for r in beside["rows"]:
            print(f"  {r['engine']:<22} B={r['batch_size']} {r['tokens_per_s']:6.1f} tok/s "
                  f"(decode {r['decode_tokens_per_s']:.1f})")
    for run in result["runs"]:
        t, lag = run["throughput"], run["lag"]
        print(f"{run['name']}: {len(run['publishes'])} publishes; trainer {t['trained_records_per_s']:.2f} records/s "
              f"trained, traffic {t['stream_records_per_s']:.2f} records/s, backlog at end {t['backlog_at_end']}; "
              f"lag completion -> published drafter median {fmt(lag.get('median_s'))} s, p90 {fmt(lag.get('p90_s'))} s "
              f"({lag['not_yet_published']} of {lag['records']} records not yet in a published drafter)")
        s = result["summary"][run["name"]]
        y = s.get("token_yield")
        if y and y.get("yield") is not None:
            parts = ", ".join(f"{use} {count:.0f}" for use, count in sorted(y["uses"].items()))
            print(f"{run['name']}: token yield {y['yield']:.2f} (useful {y['useful']:.0f} of {y['computed']:.0f} computed), "
                  f"trained share {fmt(y['trained_share'])}; {parts}")
        for key, ratios in s.get("over_llamacpp_best", {}).items():
            print(f"{run['name']} end, B={key[1:]}: tokens/s over llama.cpp's best ({ratios['llamacpp']}, "
                  f"{ratios['llamacpp_tokens_per_s']:.1f} tok/s): "
                  + ", ".join(f"{name} {value:.2f}x" for name, value in ratios.items() if not name.startswith("llamacpp")))
        if "online_over_frozen_b1" in s:
            print(f"{run['name']}: online / frozen ({s['frozen_version']}) tokens/s on held-out "
                  f"{shifted_to}: B=1 {s['online_over_frozen_b1']:.2f}x, B=4 {fmt(s['online_over_frozen_b4'])}x")


def plot(result: dict, path: Path) -> None:
    """Acceptance length and speed ratio over traffic time (publishes marked), acceptance length vs
    traffic tokens per objective, and the served acceptance length (or the shift comparison)."""
    from matplotlib.figure import Figure

    fixed_k, shifted_to = result["measurement"]["fixed_k"], result["measurement"]["shift_domains"][1]
    from specrl.apps.up import plot_yield

    fig = Figure(figsize=(12, 12))
    (acc, ratio), (objectives, extra), (yields, flow) = fig.subplots(3, 2)
    colors = [f"C{i}" for i in range(10)]
    for run, color in zip(result["runs"], colors):
        points = run["checkpoints"]
        minutes = [c["traffic_s"] / 60 for c in points]
        online = [c["drafters"]["online"] for c in points]
        acc.plot(minutes, [d["mean_acceptance_length_k4"] or 1.0 for d in online], "o-", color=color, label=run["name"])
        evals = [e for e in run["evaluations"] if e.get("candidate_tau") not in (None, "None")]
        acc.plot([e["traffic_s"] / 60 for e in evals], [float(e["candidate_tau"]) for e in evals], ":", color=color,
                 alpha=0.6, label=f"{run['name']}: trainer's held-out tau")
        for (name, shown), marker in zip(CONFIGURATIONS.items(), ("o", "^", "s")):
            series = [c["drafters"][name] for c in points if name in c["drafters"]]
            if len(series) < len(points):
                continue
            alpha = 1.0 if name == "online+suffix" else 0.55
            ratio.plot(minutes, [d["ratio_b1"] for d in series], marker + "-", color=color, alpha=alpha,
                       label=f"{run['name']} {shown} B=1")
            # B = 4: the median over rounds of the per-round ratios (one disturbed run moves the totals)
            b4 = [(m, d["ratio_b4_median"]) for m, d in zip(minutes, series) if "ratio_b4_median" in d]
            if b4:
                ratio.plot(*zip(*b4), marker + "--", color=color, mfc="none", alpha=alpha,
                           label=f"{run['name']} {shown} B=4")
            if name != "online":  # tokens per step (B=1, adaptive): the index's and the hybrid's acceptance
                acc.plot(minutes, [d["b1"]["tokens_per_step"] for d in series], marker + ("--" if name == "suffix" else "-."),
                         color=color, alpha=0.7, label=f"{run['name']}: {shown}, tokens/step B=1")
        served = [s for s in run["served"] if s.get("yield")]
        if served:
            plot_yield(yields, [s["traffic_s"] / 60 for s in served], [s["yield"] for s in served], run["name"], color)
            trainer = [(s["traffic_s"] / 60, s["trainer"]) for s in served if s.get("trainer")]
            for name, style in (("produced_records_per_s", "-"), ("consumed_records_per_s", "--")):
                flow.plot([m for m, _ in trainer], [t.get(name) for _, t in trainer], style, color=color,
                          label=f"{run['name']}: {name.split('_')[0]}")
            flow.plot([m for m, _ in trainer], [t.get("lag_records") for _, t in trainer], ":", color=color,
                      label=f"{run['name']}: lag (records)")
        for p in run["publishes"]:
            for ax in (acc, ratio):
                ax.axvline(p["traffic_s"] / 60, color=color, alpha=0.25, linewidth=0.8)
        if "frozen" not in points[-1]["drafters"]:
            objectives.plot([c["traffic_tokens"] / 1000 for c in points], [d["mean_acceptance_length_k4"] or 1.0 for d in online],
                            "o-", color=color, label=run["objective"])
            if not result["shift"]:
                served = [s for s in run["served"] if s.get("tokens_per_step")]
                extra.plot([s["traffic_s"] / 60 for s in served], [s["tokens_per_step"] for s in served],
                           color=color, label=run["name"])
        else:
            last = points[-1]
            names = ["plain", "frozen", "online"]
            values = [last["plain"]["b1"]["tokens_per_s"], last["drafters"]["frozen"]["b1"]["tokens_per_s"],
                      last["drafters"]["online"]["b1"]["tokens_per_s"]]
            extra.bar([f"{n}\n{run['name']}" for n in names], values, color=["grey", "tab:blue", color])
            extra.set_ylabel(f"tokens/s B=1, held-out {shifted_to}")
    acc.set(ylabel=f"held-out: head's acceptance length (k={fixed_k}); tokens/step", xlabel="traffic minutes (vertical: publishes)")
    ratio.axhline(1.0, color="black", linewidth=0.8)
    _llamacpp_lines(ratio, result)
    ratio.axhline(1.3, color="grey", linestyle=":", linewidth=0.8)
    ratio.set(ylabel="tokens/s over plain (held-out)", xlabel="traffic minutes")
    objectives.set(ylabel=f"acceptance length (k={fixed_k})", xlabel="traffic completion tokens (thousands)",
                   title="objectives")
    if not extra.get_ylabel():
        extra.set(ylabel="served acceptance length (live /metrics)", xlabel="traffic minutes")
    yields.set(xlabel="traffic minutes", title="effective-token yield (server + trainer /metrics)")
    flow.set(ylabel="records/s; lag in records", xlabel="traffic minutes",
             title="trainer: production vs consumption (last 30 s), lag")
    for ax in (acc, ratio, objectives, extra, flow):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    fig.suptitle(f"bench adapt: {result['model']} ({result['settings'].get('dtype', 'auto')} weights), "
                 f"{result['minutes']:g} min of traffic per run, {result['users']} users")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _llamacpp_lines(ax, result: dict) -> None:
    """llama.cpp's best B=1 end-to-end tokens/s, and twice it, on the ratio axis (over the first run's last plain)."""
    if "llamacpp" not in result or not result["runs"]:
        return
    best = llamacpp_best(result["llamacpp"]["rows"], "b1")
    if best is None:
        return
    level = best["tokens_per_s"] / result["runs"][0]["checkpoints"][-1]["plain"]["b1"]["tokens_per_s"]
    ax.axhline(level, color="tab:red", linestyle="--", linewidth=0.9, label=f"{best['engine']} B=1 (best)")
    ax.axhline(2 * level, color="tab:red", linestyle=":", linewidth=0.9, label="2x llama.cpp's best B=1")
