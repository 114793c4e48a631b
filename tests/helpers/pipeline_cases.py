"""Problems that fail the pipeline in one known way each, and the scripted LLM that writes them.

Each case is a problem whose statement carries a marker `[case:NAME]`; the scripted model copies
the marker into the task text it writes, so every later prompt (tests, solve functions) names the
case too. The environments are the ArrayGcd sample (renamed per problem) with one defect spliced
in; `EXPECTED` says where each problem must end and why.
"""

from __future__ import annotations

import json
import re
from typing import Any

from codegym_testkit.fake_llm import (
    GOOD_SOLVE,
    SAMPLE,
    SAMPLE_TASK,
    Reply,
    default_script,
    env_class_for,
    good_tests,
    own_section,
    stage_of,
)

CASE = re.compile(r"\[case:(\w+)\]")
SOLUTION = (
    "def gcd_all(nums):\n    from math import gcd\n    g = 0\n"
    "    for x in nums:\n        g = gcd(g, x)\n    return g\n"
)

MAIN_BLOCK = SAMPLE[SAMPLE.index('if __name__ == "__main__":') :]
BAD_REF = """    def get_ref_answer(self):
        first = self.nums[0] if self.nums else 0
        if first == 7001:
            return "x" * 500
        if first == 7002:
            raise ValueError("no answer for this input")
        if first == 7003:
            return len(bytearray(1 << 30))
        if first == 7004:
            while True:
                pass
"""
PEEK = '''    def Peek(self):
        r"""

        Look at a summary of the hidden array.

        Args:
            None

        Returns:
            str: The summary.

        Example Output:
            "6"
        """
        return str(self.get_ref_answer())

    def Done(self, answer: int):'''


ANSWER = '''    def Answer(self, nums: list):
        r"""

        Compute the greatest common divisor of some numbers.

        Args:
            nums (list): The numbers.

        Returns:
            str: Their greatest common divisor.

        Example Output:
            "6"
        """
        g = 0
        for value in nums:
            g = math.gcd(g, value)
        return str(g)

    def Done(self, answer: int):'''


def wrong_solve(answer: Any) -> str:
    return (
        "def solve(self):\n    import json\n"
        f"    return self.step(json.dumps({{'name': 'Done', 'parameters': {{'answer': {answer!r}}}}}))[1]\n"
    )


LOOPING_SOLVE = "def solve(self):\n    while True:\n        pass\n"
RAISING_SOLVE = "def solve(self):\n    raise RuntimeError('candidate gave up')\n"


def case_env(case: str, env_class: str) -> str:
    source = SAMPLE
    if case == "crash":
        source = source.replace("import gymnasium\n", "import gymnasium\n\n_TABLE = {}['missing']\n", 1)
    elif case == "undocumented":
        source = source.replace('        Example Output:\n            "False"\n', "", 1)
    elif case == "hang":
        source = source.replace(MAIN_BLOCK, 'if __name__ == "__main__":\n    while True:\n        pass\n')
    elif case == "bad_tests":
        source = source.replace("    def get_ref_answer(self):\n", BAD_REF, 1)
    elif case == "shortcut":
        source = source.replace('"Done": self.DONE,', '"Peek": 5,\n            "Done": self.DONE,', 1)
        source = source.replace("    def Done(self, answer: int):", PEEK, 1)
    elif case == "pays_any":
        source = source.replace("correct = answer == ref\n", "correct = True\n", 1)
    elif case == "pays_text":
        source = source.replace(
            "correct = answer == ref\n", "correct = answer == ref or answer == str(ref)\n", 1
        )
    elif case == "nondeterministic":
        source = source.replace(
            'return f"Your answer: {answer}, ', 'return f"[{id(object())}] Your answer: {answer}, ', 1
        )
    elif case == "shortcut_args":
        source = source.replace('"Done": self.DONE,', '"Answer": 5,\n            "Done": self.DONE,', 1)
        source = source.replace("    def Done(self, answer: int):", ANSWER, 1)
    elif case == "module_state":
        # Counts steps in a module global: one process per oracle run agrees with the next, but a
        # session's resident process keeps counting while every cold step starts from 0.
        source = source.replace("\n\nclass ", "\n\n_STEPS = [0]\n\n\nclass ", 1)
        source = source.replace(
            "        self.step_count += 1\n", "        self.step_count += 1\n        _STEPS[0] += 1\n", 1
        )
        source = source.replace(
            'reward={self._reward}"', 'reward={self._reward}, steps in this process: {_STEPS[0]}"', 1
        )
    source = source.replace("ArrayGcdEnv", env_class)
    task = f"{SAMPLE_TASK}\n[case:{case}]"
    return f"<task>\n{task}\n</task>\n<env>\n```python\n{source}```\n</env>"


def case_tests(case: str, env_class: str, seed: int) -> str:
    if case != "bad_tests":
        return good_tests(env_class, start=2 + seed)
    # 3 good tests and 3 of each kind of invalid one: 3/15 valid.
    lines = [f'{env_class}@{{"nums": [{6 * (i + 1)}, {9 * (i + 1)}, {15 * (i + 1)}]}}' for i in range(3)]
    for bad in (7001, 7002, 7003, 7004):
        lines += [f'{env_class}@{{"nums": [{bad}, {2 * (i + 1) + seed}]}}' for i in range(3)]
    return "<tests>\n" + "\n".join(lines) + "\n</tests>"


def case_solves(case: str, n: int) -> list[str]:
    good = GOOD_SOLVE
    if case == "no_solve":
        pool = [wrong_solve(0), wrong_solve(-1), RAISING_SOLVE, wrong_solve("6")]
    elif case == "seventh":
        pool = [
            wrong_solve(0),
            wrong_solve(1),
            RAISING_SOLVE,
            wrong_solve(2),
            wrong_solve(3),
            wrong_solve(-1),
        ]
        pool += [good, wrong_solve(4), wrong_solve(5), RAISING_SOLVE]
    elif case == "loops":
        pool = [LOOPING_SOLVE, good]
    elif case == "slow":
        pool = [
            good.replace("def solve(self):\n", "def solve(self):\n    import time\n    time.sleep(0.4)\n", 1)
        ]
    else:
        pool = [good]
    return [f"<answer>\n{pool[i % len(pool)]}</answer>" for i in range(n)]


def case_script(body: dict[str, Any]) -> Reply:
    match = CASE.search(own_section(body))
    if match is None:
        return default_script(body)
    case = match.group(1)
    n = int(body.get("n") or 1)
    stage = stage_of(body)
    if stage == "environment":
        return Reply([case_env(case, env_class_for(body))] * n)
    if stage == "unit_tests":
        return Reply([case_tests(case, env_class_for(body), i) for i in range(n)])
    if stage == "solve_functions":
        return Reply(case_solves(case, n))
    return default_script(body)


def case_problem(case: str, **extra: Any) -> dict[str, Any]:
    return {
        "question_id": f"Case_{case}",
        "question": f"Find the greatest common divisor of an array of positive integers. [case:{case}]",
        "solution": SOLUTION,
        **extra,
    }


CASES = {
    "crash": case_problem("crash"),
    "undocumented": case_problem("undocumented"),
    "hang": case_problem("hang"),
    "bad_tests": case_problem("bad_tests"),
    "disagree": case_problem(
        "disagree", solution="def gcd_all(nums):\n    return -1\n", entry_point="gcd_all", arg_names=["nums"]
    ),
    "no_solve": case_problem("no_solve"),
    "seventh": case_problem("seventh"),
    "loops": case_problem("loops"),
    "shortcut": case_problem("shortcut"),
    "pays_any": case_problem("pays_any"),
    "pays_text": case_problem("pays_text"),
    "nondeterministic": case_problem("nondeterministic"),
    "shortcut_args": case_problem("shortcut_args"),
    "module_state": case_problem("module_state"),
}
# problem id → (stage it ends in, status, reason class)
EXPECTED = {
    "Case_crash": ("check", "rejected", "main_failed"),
    "Case_undocumented": ("environment", "rejected", "contract_violation"),
    "Case_hang": ("check", "rejected", "main_timeout"),
    "Case_bad_tests": ("validate", "rejected", "too_few_valid_tests"),
    "Case_disagree": ("validate", "rejected", "too_few_valid_tests"),
    "Case_no_solve": ("solvability", "rejected", "unsolvable"),
    "Case_seventh": ("library", "passed", ""),
    "Case_loops": ("library", "passed", ""),
    "Case_shortcut": ("filters", "rejected", "shortcut"),
    "Case_pays_any": ("negative_controls", "rejected", "reward_accepts_wrong_answers"),
    "Case_pays_text": ("negative_controls", "rejected", "reward_accepts_wrong_answers"),
    "Case_nondeterministic": ("determinism", "rejected", "nondeterministic"),
    "Case_shortcut_args": ("filters", "rejected", "shortcut: Answer(nums=config['nums'])"),
    "Case_module_state": ("determinism", "rejected", "nondeterministic: resident and cold differ"),
}


def write_problems(path: Any, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
