"""Prompts of the three synthesis stages, written for this project.

Each prompt states the contract the output is checked against (the checker is strict, so the
prompt is explicit) and shows one worked example: the project's own ArrayGcd sample environment,
its task text and its problem, read from the sample data (`codegym.samples`, shipped with the
package) so the example is always a real, passing environment.
"""

from __future__ import annotations

import json
from functools import cache

from codegym.contract import parse_env_source, tools_text
from codegym.contract.source import method_source
from codegym.samples import ENVS, PROBLEMS, TASKS

ONE_SHOT_ID = "Sample_0006_I"
ONE_SHOT_ENV = "ArrayGcdEnv"

SYSTEM = (
    "You build interactive tool-use environments for training AI agents, and you follow output "
    "formats exactly: your answer is parsed by a program."
)


@cache
def one_shot() -> dict[str, str]:
    """The worked example: problem, solution, task text, env source, tool docs, tests."""
    problems = [json.loads(x) for x in PROBLEMS.read_text().splitlines() if x.strip()]
    problem = next(p for p in problems if p["question_id"] == ONE_SHOT_ID)
    env_path = ENVS / f"{ONE_SHOT_ID}__{ONE_SHOT_ENV}.py"
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines() if x.strip()]
    tests = [t for t in tasks if t["env_id"] == f"{ONE_SHOT_ID}__{ONE_SHOT_ENV}"]
    source = env_path.read_text()
    return {
        "question": problem["question"],
        "solution": problem["solution"],
        "task": env_path.with_suffix(".task.md").read_text().strip(),
        "env": source,
        "tools": tools_text(parse_env_source(source)),
        "tests": "\n".join(f"{ONE_SHOT_ENV}@{json.dumps(t['config'])}" for t in tests),
    }


ENV_RULES = """\
Rules for the environment (a program checks every one):
1. One Python file with exactly one class deriving from gymnasium.Env, named after the problem in
   PascalCase and ending in "Env".
2. __init__(self, env_str=None) builds self.func_mapping, a dict literal from each tool name to an
   action code, and loads the config given in env_str; from_env_str(env_str) is a staticmethod that
   returns None unless env_str starts with "ClassName@"; env strings are "ClassName@{json}".
3. reset(self, options) loads the task config (a dict) and returns a short message; it sets the
   step counter and the reward to 0. The config holds only the problem input, never the answer.
4. step(self, action) takes a JSON string {"name": ..., "parameters": {...}}, counts the step,
   calls the tool, and returns (True, observation_string); bad calls return an "Error: ..." string.
5. Tools are atomic PascalCase methods returning strings. Always provide Observe() (what the agent
   may see of the problem) and Done(answer), which compares with get_ref_answer(), sets a binary
   reward, ends the episode and returns "Your answer: ..., Reference answer: ..., Result: ...,
   reward=...". No tool may reveal the answer or do the whole computation in one call.
6. Every tool has a docstring with Args:, Returns: and Example Output: sections.
7. finished and reward are properties; get_ref_answer() computes the answer from the config with
   the reference solution's logic.
8. solve(self) plays the episode using only self.step(...) and returns Done's message.
9. An `if __name__ == "__main__":` block runs solve() on two test cases and prints the results.
"""

TASK_RULES = """\
The task description is what the agent reads: goal-oriented, it says what is hidden and what to
find, gives one small worked example, gives no hint about the algorithm, and never asks for code.
"""


def environment_messages(question: str, solution: str) -> list[dict[str, str]]:
    ex = one_shot()
    user = f"""Turn a coding problem into an interactive environment in which an agent solves the
problem by calling tools, one call per step.

{ENV_RULES}
{TASK_RULES}
Answer with the task description inside <task>...</task>, then the complete environment source
inside <env>...</env>. Nothing else is read.

### Example

Problem:
{ex["question"]}

Reference solution:
```python
{ex["solution"].rstrip()}
```

Answer:
<task>
{ex["task"]}
</task>
<env>
{ex["env"].rstrip()}
</env>

### Your problem

Problem:
{question.strip()}

Reference solution:
```python
{solution.rstrip()}
```

Answer:
"""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def unit_test_messages(task_text: str, env_source: str, env_class: str) -> list[dict[str, str]]:
    ex = one_shot()
    user = f"""Write task configs (unit tests) for an environment. A config is the JSON object the
environment's reset(options) loads; it holds the problem input only.

Write exactly 15 lines, one env string per line in the form {env_class}@{{json}}: lines 1-5 easy,
6-10 medium, 11-15 hard (larger inputs, more steps to solve). Use valid JSON only (double quotes,
true/false/null). Cover edge cases. Put the lines inside <tests>...</tests>.

### Example

Task:
{ex["task"]}

Environment:
```python
{ex["env"].rstrip()}
```

<tests>
{ex["tests"]}
</tests>

### Your environment

Task:
{task_text.strip()}

Environment:
```python
{env_source.rstrip()}
```
"""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def hard_test_messages(
    task_text: str, env_source: str, env_class: str, seed_tests: list[str]
) -> list[dict[str, str]]:
    seeds = "\n".join(seed_tests)
    user = f"""Write 5 HARD task configs for the environment below: inputs much larger than these
easy ones, so that solving them takes long chains of tool calls (but at most 200 calls), and
tricky edge cases. One env string per line in the form {env_class}@{{json}}, valid JSON only,
inside <tests>...</tests>.

Easy configs for reference:
{seeds}

Task:
{task_text.strip()}

Environment:
```python
{env_source.rstrip()}
```
"""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def solve_messages(task_text: str, tool_docs: str) -> list[dict[str, str]]:
    ex = one_shot()
    example_solve = method_source(ex["env"], "solve")
    user = f"""An agent solves a task by calling tools. Write the function solve(self) that solves
any instance of the task using only self.step(action), where action is a JSON string
{{"name": "ToolName", "parameters": {{...}}}} and self.step returns (True, observation_string).
Observations are strings: convert them yourself. Finish by calling Done and return its message.
You see only the tool documentation, not the implementation. Import what you need inside the
function. Put the complete function inside <answer>...</answer>.

### Example

Task:
{ex["task"]}

Tools:
{ex["tools"].strip()}

<answer>
{example_solve.strip()}
</answer>

### Your task

Task:
{task_text.strip()}

Tools:
{tool_docs.strip()}
"""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
