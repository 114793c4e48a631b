"""Tree rollouts: episodes branched N ways after chosen tool calls, each branch its own policy.

Tree-structured RL (ARPO-style entropy branching, Tree-GRPO, MCTS over tool calls) plays a shared
prefix once and continues it several ways. Here each root episode plays its first tool calls, then
at every branch point (`--branch-at`, step indices) `fork_session` copies it `--ways` ways; each
branch continues under its own random generator, so siblings share their prefix and differ after
it. A group is the branches forked from one node; its rewards are what a GRPO-style learner
compares, so they must differ for the group to teach anything.

The policy stands in for a model: it follows the task's recorded oracle trajectory (the sample
trajectories `codegym up` built its default library from; the root plays it exactly up to the
first branch point) and on a branch, with probability `--epsilon` at each step, makes a random
tool call instead: a tool of the environment's list, with arguments drawn
from the tool's JSON schema. Siblings explore by degrees, as a tree search's children do: branch i
of W strays with probability i/(W-1) x `--epsilon` (branch 0 is the greedy one). A branch that
strays may still finish the task, or break it; each draws from its own generator.

Against `codegym up` (its default library, at 127.0.0.1:50051):

    python examples/tree_rollouts/tree_rollouts.py --target 127.0.0.1:50051 --roots 4 --ways 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegym_client import AsyncRuntimeClient

TRAJECTORIES = Path(__file__).resolve().parents[2] / "codegym" / "samples" / "trajectories.jsonl"


@dataclass
class Branch:
    """One session of the tree: where it is in the recorded trajectory, and its own RNG."""

    session_id: str
    cursor: int  # the next recorded action to follow
    rng: random.Random
    path: str  # e.g. "2.0.3": root 2, its branch 0, that branch's branch 3
    epsilon: float  # its chance of a random tool call at each step
    reward: float = 0.0
    done: bool = False
    steps: int = 0


@dataclass
class Tree:
    """Everything one root grew: each group's rewards, keyed by the node it branched from."""

    groups: dict[str, list[float]] = field(default_factory=dict)


def random_value(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value of a JSON schema's type (small ints, short words, short int lists)."""
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(-3, 12)
    if kind == "number":
        return round(rng.uniform(-3, 12), 1)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
    if kind == "object":
        return {}
    return rng.choice(["a", "b", "yes", "no", "0", "1"])


def random_call(tools: list[dict[str, Any]], rng: random.Random) -> str:
    """A valid tool call: a listed tool, every required argument of its schema's type."""
    tool = rng.choice(tools)
    params = tool.get("parameters") or {}
    properties = params.get("properties") or {}
    arguments = {name: random_value(properties.get(name, {}), rng) for name in params.get("required", [])}
    return json.dumps({"name": tool["name"], "parameters": arguments})


def tool_schemas(created: Any) -> list[dict[str, Any]]:
    """The environment's tools as OpenAI function definitions (`CreateSessionResponse.tools`)."""
    out = []
    for spec in created.tools:
        schema = json.loads(spec.json_schema)
        out.append(schema.get("function", schema))
    return out


class Rollouts:
    """The trees of one run, on one client: roots, forks at the branch points, leaves."""

    def __init__(self, client: AsyncRuntimeClient, args: argparse.Namespace) -> None:
        self.client = client
        self.args = args
        self.branch_at = sorted(set(args.branch_at))

    def action(self, branch: Branch, recorded: list[str], tools: list[dict[str, Any]]) -> str:
        """The recorded call next (the cursor moves on), or, with the branch's own chance, a
        random one (the cursor stays: the branch may still get back on track). A root's epsilon
        is 0: its prefix, up to the first branch point, is the recording's."""
        if branch.rng.random() < branch.epsilon:
            return random_call(tools, branch.rng)
        action = recorded[branch.cursor]
        branch.cursor += 1
        return action

    async def grow(
        self, branch: Branch, recorded: list[str], tools: list[dict[str, Any]], tree: Tree
    ) -> list[float]:
        """Play `branch` to its next branch point (fork it, grow each fork) or to its end; returns
        the rewards of the leaves under it."""
        while not branch.done and branch.cursor < len(recorded):
            if branch.steps in self.branch_at and branch.steps > 0:
                return await self.split(branch, recorded, tools, tree)
            response = await self.client.step(branch.session_id, self.action(branch, recorded, tools))
            branch.steps, branch.reward, branch.done = response.step_index, response.reward, response.done
        await self.client.close_session(branch.session_id)
        return [branch.reward]

    async def split(
        self, branch: Branch, recorded: list[str], tools: list[dict[str, Any]], tree: Tree
    ) -> list[float]:
        forks = await self.client.fork_session(branch.session_id, count=self.args.ways)
        await self.client.close_session(branch.session_id)  # the node itself goes no further
        children = [
            Branch(
                fork.session_id,
                branch.cursor,
                random.Random(f"{self.args.seed}/{branch.path}.{i}"),  # each branch its own RNG
                f"{branch.path}.{i}",
                self.args.epsilon * i / max(1, len(forks) - 1),
                fork.reward,
                fork.done,
                fork.step_index,
            )
            for i, fork in enumerate(forks)
        ]
        leaves = await asyncio.gather(*(self.descend(child, recorded, tools, tree) for child in children))
        # A group: the siblings' rewards (a sibling that branched again: the mean of its leaves).
        tree.groups[f"{branch.path} @ step {branch.steps}"] = [sum(x) / len(x) for x in leaves]
        return [reward for rewards in leaves for reward in rewards]

    async def descend(
        self, child: Branch, recorded: list[str], tools: list[dict[str, Any]], tree: Tree
    ) -> list[float]:
        """A fork continues past the point it was forked at, to the next one."""
        if child.done or child.cursor >= len(recorded):
            await self.client.close_session(child.session_id)
            return [child.reward]
        response = await self.client.step(child.session_id, self.action(child, recorded, tools))
        child.steps, child.reward, child.done = response.step_index, response.reward, response.done
        return await self.grow(child, recorded, tools, tree)

    async def root(self, index: int, line: dict[str, Any]) -> Tree:
        created = await self.client.create_session(env_id=line["env_id"], config=line["config"], seed=index)
        recorded = [action for action, _ in line["steps"]]
        rng = random.Random(f"{self.args.seed}/{index}")
        tree = Tree()
        root = Branch(created.session_id, 0, rng, str(index), 0.0)
        await self.grow(root, recorded, tool_schemas(created), tree)
        return tree


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="the runtime (`codegym up` prints it)")
    parser.add_argument("--roots", type=int, default=4, help="root episodes")
    parser.add_argument("--ways", type=int, default=4, help="forks at each branch point")
    parser.add_argument(
        "--branch-at",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[3],
        help="step indices to branch after, e.g. 3 or 3,6 (a tree of two levels)",
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=1.0,
        help="the most exploring branch's chance of a random tool call per step",
    )
    parser.add_argument(
        "--min-steps", type=int, default=8, help="tasks whose oracle takes at least this many"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trajectories", type=Path, default=TRAJECTORIES)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    lines = [json.loads(x) for x in args.trajectories.read_text().splitlines() if x.strip()]
    lines = [x for x in lines if len(x.get("steps") or []) >= max(args.min_steps, max(args.branch_at) + 2)]
    if not lines:
        print(f"no trajectory of {args.trajectories} is long enough", file=sys.stderr)
        return 2
    chosen = random.Random(args.seed).sample(lines, min(args.roots, len(lines)))
    async with AsyncRuntimeClient(args.target) as client:
        await client.wait_ready(30)
        rollouts = Rollouts(client, args)
        trees = await asyncio.gather(*(rollouts.root(i, line) for i, line in enumerate(chosen)))
    differ = 0
    total = 0
    for line, tree in zip(chosen, trees, strict=True):
        for node, rewards in sorted(tree.groups.items()):
            total += 1
            differ += len(set(rewards)) > 1
            shown = " ".join(f"{r:.2f}" for r in rewards)
            print(f"group {node} ({line['env_id']}): rewards {shown}")
    print(f"{total} groups, {differ} with rewards that differ")
    return 0


def main() -> None:
    sys.exit(asyncio.run(run(parse_args())))


if __name__ == "__main__":
    main()
