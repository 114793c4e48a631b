"""The eval bench's table (bench/eval_bench.py): per concurrency level, a column of rows read from
one run's figures (throughput, model turns against the bare scripted server, an episode's cost,
CPU by role), and the table printed.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import median, pct
from bench.eval_meter import Meter


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def spread(values: list[float]) -> str:
    """mean / p50 / p99 in ms."""
    if not values:
        return "-"
    return f"{ms(mean(values))} / {ms(median(values))} / {ms(pct(values, 0.99))}"


def share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f} %" if whole > 0 else "-"


Rows = list[tuple[str, str]]


def throughput_rows(run: dict[str, Any]) -> Rows:
    """Episodes and turns played, and how fast."""
    turns = len(run["meter"].wall["step"])  # steps made, finished episodes or not
    episodes = run["episodes"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(run["end_reasons"].items())) or "-"
    finished_turns = sum(e["turns"] for e in episodes)
    return [
        (
            "episodes finished of planned (end reasons)",
            f"{len(episodes)} of {run['total']}{', capped' if run['capped'] else ''} ({reasons})",
        ),
        ("turns made (mean per finished episode)", f"{turns} ({finished_turns / max(1, len(episodes)):.1f})"),
        ("wall time s", f"{run['wall']:.1f}"),
        ("episodes/s", f"{len(episodes) / run['wall']:.2f}"),
        ("turns/s", f"{turns / run['wall']:.0f}"),
        ("LLM retries (scripted server refusing connections)", f"{run['retries']}"),
    ]


def turn_rows(run: dict[str, Any], baseline: tuple[float, list[float]]) -> Rows:
    """A turn's wall time split: (a) the runtime step, (b) the LLM call, (c) the agent loop."""
    meter: Meter = run["meter"]
    step, chat, loop = meter.wall["step"], meter.wall["chat"], meter.loop_wall
    a, c = mean(step), mean(loop)
    base_rate, base = baseline
    srv = run["server"]
    per_request = 1000 / max(1, srv["requests"])
    return [
        ("(a) runtime step ms: mean / p50 / p99", spread(step)),
        ("(a0) same, runtime alone (oracle replay, LLM idle)", spread(base)),
        ("  (a0) steps measured, steps/s", f"{len(base)}, {base_rate:.0f}"),
        ("(b) LLM call ms: mean / p50 / p99", spread(chat)),
        (
            "  scripted server in (b): handler wall / CPU ms per request",
            f"{srv['wall'] * per_request:.3f} / {srv['cpu'] * per_request:.3f}",
        ),
        (
            "  of which the oracle script CPU ms; connections per request",
            f"{srv['script_cpu'] * per_request:.3f}; {srv['connections'] * per_request / 1000:.2f}",
        ),
        ("(c) agent loop ms: mean / p50 / p99", spread(loop)),
        ("(c) / (a), mean  [target < 10 %]", share(c, a)),
        ("(c) / (a0), mean", share(c, mean(base))),
        ("(c) / (a), p50", share(median(loop), median(step)) if loop else "-"),
    ]


def episode_cost_rows(run: dict[str, Any]) -> Rows:
    """Per episode: its session calls, and its record in episodes.jsonl."""
    meter: Meter = run["meter"]
    episodes = run["episodes"]
    finished_turns = sum(e["turns"] for e in episodes)
    return [
        ("create + close session ms per episode (mean)", ms(2 * mean(meter.wall["session"]))),
        (
            "episode record (episodes.jsonl): KiB each; json.dumps CPU ms/turn",
            f"{run['record_bytes'] / 1024 / max(1, len(episodes)):.1f}; "
            f"{run['record_cpu'] * 1000 / max(1, finished_turns):.3f}",
        ),
    ]


def cpu_rows(run: dict[str, Any]) -> Rows:
    """CPU per turn: this process split by thread and by call, and `codegym up` by role."""
    meter: Meter = run["meter"]
    per_turn = 1000 / max(1, len(meter.wall["step"]))  # seconds in total -> ms per turn
    srv = run["server"]
    cpu = meter.cpu
    own = cpu["step"] + cpu["chat"] + cpu["loop"] + cpu["session"]
    up = run["up"]
    up_total = sum(up.values())

    def client_cpu(low: int, high: int) -> str:
        picked = [cpu for turn, cpu in meter.chat_cpu_by_turn if low <= turn <= high]
        return f"{ms(mean(picked))}" if picked else "-"

    return [
        ("CPU ms per turn, bench process (process_time)", f"{run['process_cpu'] * per_turn:.3f}"),
        ("  event-loop thread (thread_time)", f"{run['loop_thread_cpu'] * per_turn:.3f}"),
        ("    (a) inside the step call (gRPC client)", f"{cpu['step'] * per_turn:.3f}"),
        ("    (b) inside the LLM call (openai client)", f"{cpu['chat'] * per_turn:.3f}"),
        ("    (c) agent loop", f"{cpu['loop'] * per_turn:.3f}"),
        ("    create + close session calls", f"{cpu['session'] * per_turn:.3f}"),
        (
            "    rest: asyncio, transport callbacks, episodes.jsonl",
            f"{(run['loop_thread_cpu'] - own) * per_turn:.3f}",
        ),
        ("  scripted server threads (b)", f"{srv['cpu'] * per_turn:.3f}"),
        (
            "  other threads (gRPC core, HTTP accept)",
            f"{(run['process_cpu'] - run['loop_thread_cpu'] - srv['cpu']) * per_turn:.3f}",
        ),
        (
            "(b) openai client CPU ms per call: turns 1-10 / 11-40 / 41+",
            f"{client_cpu(1, 10)} / {client_cpu(11, 40)} / {client_cpu(41, 10**9)}",
        ),
        ("(c) CPU / (a) CPU inside the step call", f"{100 * cpu['loop'] / max(1e-9, cpu['step']):.1f} %"),
        (
            "codegym up CPU ms per turn: runtime / worker / jail",
            " / ".join(f"{up[r] * per_turn:.3f}" for r in ("runtime", "worker", "jail")),
        ),
        ("(c) CPU / codegym up CPU per turn", f"{100 * cpu['loop'] / max(1e-9, up_total):.1f} %"),
    ]


def rows_of(run: dict[str, Any], baseline: tuple[float, list[float]]) -> Rows:
    """Every figure of one concurrency level, as (name, value) rows."""
    return throughput_rows(run) + turn_rows(run, baseline) + episode_cost_rows(run) + cpu_rows(run)


def print_table(args: argparse.Namespace, tasks: int, columns: list[tuple[int, Rows]]) -> None:
    """One line per figure, one column per concurrency level."""
    names = [name for name, _ in columns[0][1]]
    width = max(len(n) for n in names)
    value_width = max(len(v) for _, rows in columns for _, v in rows)
    print(
        f"{tasks} tasks x {args.samples} samples, oracle agent (scripted OpenAI-compatible server in "
        f"this process), text tool mode, codegym up with 2 sandbox workers, cap {args.max_seconds:.0f} s"
    )
    print(f"{'figure':<{width}}  " + "  ".join(f"{f'concurrency {c}':>{value_width}}" for c, _ in columns))
    for i, name in enumerate(names):
        print(f"{name:<{width}}  " + "  ".join(f"{rows[i][1]:>{value_width}}" for _, rows in columns))
