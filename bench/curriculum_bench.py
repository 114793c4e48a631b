"""Curriculum benchmark: does choosing tasks from the served record keep GRPO groups informative,
and does keeping that record cost the step path anything?

A GRPO group whose 8 episodes all score the same has zero advantage. The runtime records each
finished episode per task configuration and trainer run; `SampleTasks` chooses a run's next tasks
from that record. Two parts, each measurement on a fresh `codegym up` (2 sandbox workers, 1
runtime, loopback; bench/rollout_bench.py's `up`, stopped by pid):

  curriculum  --envs variants of the 12 samples in the published Parquet layout (the rows of
              bench/library_scale.py: each task with its oracle's actions, `std_traj`), imported by
              `codegym library import`. A simulated learner's skill per task, fixed by --seed: 40 % never solved,
              30 % always, 30 % solved with a probability drawn in [0.2, 0.8]. A success plays the
              oracle's actions; a failure plays them with a wrong `Done` answer (same type); every
              reward is checked against what was meant, so the simulation cannot silently be wrong.
              A training step plays B configurations x 8 episodes (--batch 16: 128 episodes at
              once, no think time) under the arm's run id and `policy_version=step`, then trains: a
              task's probability rises by 0.05 per group of it with mixed rewards (capped at 1).
              Arms, each on its own stack and copy of the library (one arm's record never steers
              the other): "uniform" draws B tasks uniformly; "curriculum" asks
              `sample_tasks(run_id, B, seed=step)` (the runtime's defaults). The published pass
              rates that seed the record before a run plays a task (--prior): "bo4" (default) the
              starting learner's own Bo4/Bo8, as CodeGym published them for the model it trains;
              "random" library_scale's made-up ones; "none" absent.
              Per arm over --steps: zero-variance groups % (all 8 rewards equal; also over the
              second half), useful episodes per 1,000 served (those of mixed groups), the learner's
              mean pass rate over all tasks before and after. Target: curriculum zero-variance
              <= 10 % where uniform gives >= 50 %. After each arm the runtime's own count
              (RunHistory: each step's groups and zero-variance groups, a step being a policy
              version) must equal what the bench played, or the bench stops; each step's figures
              keep the record's pool moves.
  recording   rollout_bench's steady shape (256 rollouts thinking 1 s, 20 s windows) on the 12
              samples, recording on and off (`codegym up --no-record`), alternating (on/off,
              off/on, ...) for --repeats rounds: step p50/p99 per run, the episodes the runtime
              recorded (n/a when off: it keeps no record and refuses Stats). Target, for p50 and
              p99: |median on - median off| below the run-to-run spread (the larger max - min).

  scale       what reading the record costs at the published library's size, in both stores,
              beside the base commit (--base, or --no-base): SampleTasks of 512 and Stats
              --played-only at the server, `codegym library stats --run R --played-only` end to
              end, and the runtime's idle CPU against the sample library's (bench/curriculum_scale.py
              has the details). Targets: SampleTasks <= 100 ms, the command <= 1 s, idle CPU flat.

Progress goes to stderr, tables to stdout, every figure (each training step's too) to --json FILE.

    .venv/bin/python bench/curriculum_bench.py [--quick] [--parts curriculum,recording,scale]
        [--envs 300] [--steps 40] [--batch 16] [--prior bo4|random|none] [--repeats 3]
        [--steady 256:1] [--window-s 20] [--base REV | --no-base] [--scale-envs 22366]
        [--record-episodes 2000] [--scale-calls 7] [--idle-s 35] [--json FILE]

--quick: 120 envs, 8 steps per arm, 64 rollouts thinking 0.25 s, 8 s windows, 2 rounds, and for
scale 2,000 envs, 3 calls, 10 s idle (minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Figures,
    median,
    progress,
)
from bench.curriculum_scale import SCALE_COLUMNS, run_scale, scale_targets  # noqa: E402
from bench.curriculum_targets import (  # noqa: E402
    CURRICULUM_COLUMNS,
    RECORDING_COLUMNS,
    curriculum_targets,
    recording_targets,
)
from bench.episodes import DEFAULT_RETRY_S  # noqa: E402
from bench.library_build import run_import  # noqa: E402
from bench.library_data import (  # noqa: E402
    ENVS_DIR,
    TASKS_DIR,
    TRAJECTORIES,
    Variants,
    env_rows,
    env_schema,
    load_samples,
    task_rows,
    task_schema,
    write_shards,
)
from bench.load import CLIENT_TIMEOUT_S, Plan, measure  # noqa: E402
from bench.rollout_bench import points  # noqa: E402
from bench.stacks import StackSpec, git, stack_specs, up  # noqa: E402
from bench.tables import print_table, report_busy  # noqa: E402
from bench.targets import print_targets  # noqa: E402
from codegym_client.abilities import make_ability  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.errors import CapacityExceeded, InvalidRequest  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402

PARTS = ("curriculum", "recording", "scale")
ARMS = ("uniform", "curriculum")
GROUP = 8  # episodes of one configuration: a GRPO group
LEARN_RATE = 0.05  # a task's probability rises this much per group of it with mixed rewards


# ---------------------------------------------------------------------------------------------
# The simulated learner and the tasks it plays.


@dataclass(frozen=True)
class Task:
    """A task configuration of the library and the actions an episode of it sends."""

    env_id: str
    config: dict[str, Any]
    actions: list[str]  # the oracle's, ending with its `Done`
    wrong_done: str  # the same `Done` with a wrong answer of the same type


def task_key(ability: str) -> str:
    """A task's key from its ability string, whatever JSON spacing the library keeps."""
    _, env_id, config = ability.split("@", 2)
    return f"{env_id}@{json.dumps(json.loads(config), sort_keys=True)}"


def ability(task: Task) -> str:
    return make_ability(task.env_id, task.config)


def wrong(answer: Any) -> Any:
    """An answer of the same type that no reference equals."""
    if isinstance(answer, bool):
        return not answer
    if isinstance(answer, int | float):
        return answer + 1
    if isinstance(answer, str):
        return answer + "#"
    if isinstance(answer, list):
        return [*answer, answer[-1]] if answer else [0]
    raise ValueError(f"no wrong answer made for {answer!r}")


def library_tasks(variants: Variants) -> list[Task]:
    """Every task row of the generated library, in library_scale's order (its `task_rows`)."""
    tasks = []
    for n in range(variants.n):
        for which in variants.tasks(n):
            line = variants.sample(n).lines[which]
            actions = [action for action, _ in line["steps"]]
            done = json.loads(actions[-1])
            if done["name"] != "Done":
                raise ValueError(f"{variants.env_id(n)}: the oracle's last action is not Done: {done}")
            done["parameters"]["answer"] = wrong(done["parameters"]["answer"])
            tasks.append(Task(variants.env_id(n), line["config"], actions, json.dumps(done)))
    return tasks


def drawn_skill(count: int, seed: int) -> list[float]:
    """The learner's probability of solving each task: 40 % never, 30 % always, 30 % in [0.2, 0.8]."""
    rng = random.Random(f"learner:{seed}")
    kinds = [rng.random() for _ in range(count)]
    return [0.0 if k < 0.4 else 1.0 if k < 0.7 else rng.uniform(0.2, 0.8) for k in kinds]


PRIORS = ("bo4", "random", "none")
PRIOR_KEYS = {"qwen32b_Bo4_score": 4, "qwen32b_Bo8_score": 8}


def prior_rows(variants: Variants, skill: list[float], prior: str, seed: int) -> Iterator[dict[str, Any]]:
    """library_scale's task rows with the published pass rates --prior names (see the docstring)."""
    rng = random.Random(f"prior:{seed}")
    for p, row in zip(skill, task_rows(variants), strict=True):
        for key, draws in PRIOR_KEYS.items():
            if prior == "bo4":
                row["extra_info"][key] = sum(rng.random() < p for _ in range(draws)) / draws
            elif prior == "none":
                row["extra_info"][key] = None
        yield row


def build_library(
    variants: Variants, skill: list[float], args: argparse.Namespace, workdir: Path, logs: Path
) -> Path:
    """The variants in the published Parquet layout, imported by `codegym library import`."""
    dataset, library = workdir / "dataset", workdir / "imported.db"
    write_shards(env_rows(variants), dataset / ENVS_DIR, env_schema(), variants.n, 2)
    rows = prior_rows(variants, skill, args.prior, args.seed)
    write_shards(rows, dataset / TASKS_DIR, task_schema(), len(skill), 2)
    imported = run_import([dataset], library, logs / "import.log", 1800.0)
    if imported["exit_code"] or imported["envs"] < variants.n or imported["tasks"] < len(skill):
        raise SystemExit(f"importing {variants.n} envs failed: {imported} (log {logs / 'import.log'})")
    progress(
        f"library: {imported['envs']:,} envs, {len(skill):,} tasks, imported in {imported['import_s']:.0f} s"
    )
    return library


# ---------------------------------------------------------------------------------------------
# Playing: an episode, a training step, an arm.


class SimulationWrong(AssertionError):
    """A success was not rewarded or a failure was: the simulation does not mean what it says."""


class RecordWrong(AssertionError):
    """The runtime's history (RunHistory) counts a step's groups otherwise than the bench played them."""


async def resent(call: Any, *args: Any, **kwargs: Any) -> Any:
    """`await call(...)`, sent again after each capacity refusal, as a trainer would."""
    while True:
        try:
            return await call(*args, **kwargs)
        except CapacityExceeded as exc:
            await asyncio.sleep(exc.retry_after_s or DEFAULT_RETRY_S)


async def episode(
    client: AsyncRuntimeClient, name: str, task: Task, success: bool, run_id: str, step: int
) -> bool:
    """One episode (task named by ability string `name`) under the run: the oracle's actions, the
    last one wrong unless `success`; whether it was rewarded, checked against `success`."""
    created = await resent(client.create_session, ability=name, run_id=run_id, policy_version=step)
    try:
        for action in task.actions if success else [*task.actions[:-1], task.wrong_done]:
            answer = await resent(client.step, created.session_id, action)
    finally:
        with contextlib.suppress(Exception):
            await client.close_session(created.session_id)
    if not answer.done or (answer.reward > 0) != success:
        raise SimulationWrong(
            f"{task.env_id} {task.config}: meant {'success' if success else 'failure'}, got done="
            f"{answer.done} reward={answer.reward}: {answer.observation[:200]}"
        )
    return success


@dataclass
class Arm:
    """One arm's run: the learner's skill, its draws, and what each training step did."""

    name: str
    run_id: str
    tasks: list[Task]
    skill: list[float]
    rng: random.Random
    steps: list[Figures] = field(default_factory=list)

    async def choose(
        self, client: AsyncRuntimeClient, step: int, batch: int
    ) -> tuple[list[tuple[str, int]], Figures]:
        """(ability, task index) of the step's configurations, and what the sampler said."""
        if self.name == "uniform":
            return [(ability(self.tasks[i]), i) for i in self.rng.sample(range(len(self.tasks)), batch)], {}
        index = {task_key(ability(t)): i for i, t in enumerate(self.tasks)}
        started = time.monotonic()
        answer = await client.sample_tasks(self.run_id, batch, seed=step)
        picked = [(t.ability, index[task_key(t.ability)]) for t in answer.tasks]
        chosen = dict(Counter(t.pool for t in answer.tasks))
        return picked, {"sample_s": time.monotonic() - started, "pools": dict(answer.pools), "chosen": chosen}

    async def train_step(self, client: AsyncRuntimeClient, step: int, batch: int) -> Figures:
        """Play the step's groups at once, then train on each group with mixed rewards."""
        started = time.monotonic()
        chosen, sampler = await self.choose(client, step, batch)
        draws = [[self.rng.random() < self.skill[i] for _ in range(GROUP)] for _, i in chosen]
        plays = [
            episode(client, name, self.tasks[i], success, self.run_id, step)
            for (name, i), group in zip(chosen, draws, strict=True)
            for success in group
        ]
        passed = await asyncio.gather(*plays)
        mixed = [len(set(passed[g * GROUP : (g + 1) * GROUP])) == 2 for g in range(len(chosen))]
        for (_, i), useful in zip(chosen, mixed, strict=True):
            self.skill[i] = min(1.0, self.skill[i] + LEARN_RATE) if useful else self.skill[i]
        return {
            "step": step,
            "groups": len(chosen),
            "zero_variance": mixed.count(False),
            "seconds": time.monotonic() - started,
            "pass_rate": mean(self.skill),
            "env_steps": GROUP * sum(len(self.tasks[i].actions) for _, i in chosen),
            **sampler,
        }

    def summary(self, start_rate: float) -> Figures:
        def zero_pct(steps: list[Figures]) -> float:
            return 100 * sum(s["zero_variance"] for s in steps) / sum(s["groups"] for s in steps)

        chosen: Counter[str] = Counter()
        for s in self.steps:
            chosen.update(s.get("chosen", {}))
        zero = zero_pct(self.steps)
        return {
            "steps": len(self.steps),
            "groups": sum(s["groups"] for s in self.steps),
            "zero_variance_pct": zero,
            "zero_variance_late_pct": zero_pct(self.steps[len(self.steps) // 2 :]),
            "useful_per_1000": 10 * (100 - zero),  # every group has GROUP episodes
            "pass_rate_start": start_rate,
            "pass_rate_end": mean(self.skill),
            "seconds_per_step": median([s["seconds"] for s in self.steps]),
            "chosen_by_pool": dict(chosen),
            "trace": self.steps,
        }


async def play_arm(address: str, arm: Arm, args: argparse.Namespace) -> Figures:
    start_rate = mean(arm.skill)
    async with AsyncRuntimeClient(address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        for step in range(args.steps):
            arm.steps.append(figures := await arm.train_step(client, step, args.batch))
            progress(
                f"{arm.name} step {step}: {figures['zero_variance']}/{figures['groups']} zero-variance, pass "
                f"rate {figures['pass_rate']:.3f}, {figures['env_steps']} env steps in {figures['seconds']:.1f} s"
                f" (sampler {figures.get('sample_s', 0):.2f} s) {figures.get('chosen', '')}"
            )
        check_history(arm, await client.run_history(arm.run_id))
    return arm.summary(start_rate)


def check_history(arm: Arm, points: list[Any]) -> None:
    """The runtime's count of each step's groups (RunHistory: a step is a policy version) against
    the groups the bench played: B distinct tasks x 8 episodes, zero-variance when all 8 rewards
    are equal. Each step's figures get the record's, with its pool moves."""
    by_version = {int(p.policy_version): p for p in points}
    for figures in arm.steps:
        point = by_version.get(figures["step"])
        got = (
            (0, 0, 0)
            if point is None
            else (point.groups, point.multi_episode_groups, point.zero_variance_groups)
        )
        want = (figures["groups"], figures["groups"], figures["zero_variance"])
        if got != want:
            raise RecordWrong(
                f"{arm.name} step {figures['step']}: RunHistory counts {got}, the bench played {want}"
            )
        figures["record_moves"] = (
            {} if point is None else {f"{m.from_pool}>{m.to_pool}": m.tasks for m in point.moves}
        )


def run_curriculum(args: argparse.Namespace, workdir: Path, logs: Path, revision: str) -> list[Figures]:
    variants = Variants(load_samples(TRAJECTORIES), args.envs, seed=args.seed)
    tasks = library_tasks(variants)
    library = build_library(variants, drawn_skill(len(tasks), args.seed), args, workdir, logs)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    rows = []
    for name in ARMS:
        copy = workdir / f"{name}.db"
        for suffix in ("", "-wal"):
            if Path(f"{library}{suffix}").exists():
                shutil.copyfile(f"{library}{suffix}", f"{copy}{suffix}")
        run_id = f"bench-{name}-{stamp}"
        arm = Arm(name, run_id, tasks, drawn_skill(len(tasks), args.seed), random.Random(args.seed))
        progress(f"{name}: {args.steps} steps of {args.batch} x {GROUP} episodes, run {run_id}")
        with up(StackSpec(name, ROOT, revision, copy, logs / f"{name}.log")) as stack:
            figures = asyncio.run(play_arm(stack.address, arm, args))
        rows.append({"stack": "new", "point": name, "tasks": len(tasks), **figures})
    return rows


# ---------------------------------------------------------------------------------------------
# Recording on and off under the rollout shape.


async def recorded_episodes(address: str) -> int | None:
    """Episodes the runtime has recorded; None when it keeps no record (it refuses Stats)."""
    async with AsyncRuntimeClient(address, timeout_s=CLIENT_TIMEOUT_S) as client:
        try:
            return sum(e.env.episodes for e in await client.stats(envs_only=True, played_only=True))
        except InvalidRequest:
            return None


def run_recording(args: argparse.Namespace, workdir: Path, logs: Path, revision: str) -> list[Figures]:
    """Each run on a fresh stack and a fresh sample library (built by `codegym up`): no record carried over."""
    lines = [line for line in read_trajectories(TRAJECTORIES) if line.get("steps")]
    n, think = args.steady
    rows = []
    for round_ in range(1, args.repeats + 1):
        for name in ("on", "off") if round_ % 2 else ("off", "on"):
            progress(f"recording {name}, round {round_}: {n} rollouts thinking {think:g} s")
            up_args = ("--no-record",) if name == "off" else ()
            spec = StackSpec(
                name, ROOT, revision, workdir / f"record-{name}-{round_}.db", logs / "record.log", up_args
            )
            plan = Plan(n, think, args.window_s, args.max_seconds, 50_000, args.seed + round_)
            with up(spec) as stack:
                figures = asyncio.run(measure(stack, lines, plan))
                figures["recorded"] = asyncio.run(recorded_episodes(stack.address))
            progress(
                f"recording {name}: p50 {figures['p50_ms'] or 0:.1f} ms, p99 {figures['p99_ms'] or 0:.1f} ms"
            )
            rows.append({"stack": name, "point": f"round {round_}", **figures})
    return rows


# ---------------------------------------------------------------------------------------------
# Command line (the tables and targets: bench/curriculum_targets.py).


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    add("--envs", type=int, help="environments in the generated library (300; --quick 120)")
    add("--steps", type=int, help="training steps per arm (40; --quick 8)")
    add("--batch", type=int, default=16, help="configurations per training step")
    add("--prior", choices=PRIORS, default="bo4", help="published pass rates seeding the record")
    add("--repeats", type=int, help="rounds of recording on and off (3; --quick 2)")
    add("--steady", type=lambda s: points(s)[0], default=(256, 1.0), help="N:T of the steady shape")
    add("--window-s", type=float, default=20.0, help="steady window after the warm-up, s")
    add("--max-seconds", type=float, default=120.0, help="time cap of each steady run")
    add("--base", default="0968435", help="scale: the base commit measured beside the working tree")
    add("--no-base", action="store_true", help="scale: the working tree only")
    add("--up-args", default="", help=argparse.SUPPRESS)  # stack_specs reads it
    add("--scale-envs", type=int, help="scale: environments of the big library (22366: 80,000+ tasks)")
    add("--record-episodes", type=int, default=2000, help="scale: episodes in the record's 8 runs")
    add("--scale-calls", type=int, help="scale: calls timed per figure (7; --quick 3)")
    add("--idle-s", type=float, help="scale: idle window of the CPU figure, s (35; --quick 10)")
    add("--seed", type=int, default=1)
    add("--json", type=Path, help="also write every figure to this file")
    add(
        "--quick", action="store_true", help="smoke run: 120 envs, 8 steps, N/4 at T/4, 8 s windows, 2 rounds"
    )
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    args.envs = args.envs or (120 if args.quick else 300)
    args.steps = args.steps or (8 if args.quick else 40)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.scale_envs = args.scale_envs or (2000 if args.quick else 22366)
    args.scale_calls = args.scale_calls or (3 if args.quick else 7)
    args.idle_s = args.idle_s or (10.0 if args.quick else 35.0)
    if args.quick:
        n, think = args.steady
        args.steady = (max(1, n // 4), max(0.25, think / 4))
        args.window_s, args.max_seconds = min(args.window_s, 8.0), min(args.max_seconds, 60.0)
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the blocks below stop the servers
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    revision = git("rev-parse", "--short", "HEAD") + dirty
    results: dict[str, list[Figures]] = {}
    verdicts: list[Figures] = []
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-curriculum-bench-"))
        workdir.chmod(0o755)
        cleanup.callback(shutil.rmtree, workdir, True)
        logs = Path(tempfile.mkdtemp(prefix="codegym-curriculum-bench-logs-"))
        progress(f"logs in {logs}")
        specs = [StackSpec("new", ROOT, revision, workdir, logs)]
        if "curriculum" in args.parts:
            results["curriculum"] = run_curriculum(args, workdir, logs, revision)
            print_table("curriculum", results["curriculum"], specs, CURRICULUM_COLUMNS)
            verdicts += curriculum_targets(results["curriculum"])
        if "recording" in args.parts:
            results["recording"] = run_recording(args, workdir, logs, revision)
            print_table("recording", results["recording"], specs, RECORDING_COLUMNS)
            verdicts += recording_targets(results["recording"])
        if "scale" in args.parts:
            scale_specs = stack_specs(args, cleanup, workdir)
            results["scale"] = run_scale(args, scale_specs, workdir, logs)
            print_table("scale", results["scale"], scale_specs, SCALE_COLUMNS)
            verdicts += scale_targets(results["scale"])
        print_targets(verdicts)
        report_busy({"recording": results.get("recording", [])})  # contended latencies named
    if args.json:
        meta = {"revision": revision, "args": vars(args), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
        document = {"meta": meta, "parts": results, "targets": verdicts}
        args.json.write_text(json.dumps(document, indent=2, default=str))
        progress(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
