import ast
import json

import gymnasium


class MergeIntervalsEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.SORT_BY_START = 1
        self.OVERLAPS = 2
        self.MERGE_TWO = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "SortByStart": self.SORT_BY_START,
            "Overlaps": self.OVERLAPS,
            "MergeTwo": self.MERGE_TWO,
            "Done": self.DONE,
        }
        if env_str is not None:
            self.reset(_parse_config(env_str))
        else:
            self.reset()

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def reward(self):
        return float(self._reward)

    @staticmethod
    def from_env_str(env_str: str):
        if not env_str.startswith("MergeIntervalsEnv@"):
            return None
        return MergeIntervalsEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.intervals = [list(i) for i in options.get("intervals", [])]
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        out = []
        for s, e in sorted(self.intervals):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    def step(self, action: str):
        self.step_count += 1
        try:
            call = json.loads(action)
            name, params = call["name"], call.get("parameters", {})
            if name not in self.func_mapping:
                raise ValueError(f"Invalid action: {name}")
            msg = getattr(self, name)(**params)
        except Exception as exc:
            msg = f"Error: {exc}"
        return True, msg

    def Observe(self):
        r"""

        Get the hidden intervals.

        Args:
            None

        Returns:
            str: JSON list of [start, end] pairs.

        Example Output:
            "[[1, 3], [2, 6]]"
        """
        return json.dumps(self.intervals)

    def SortByStart(self, intervals: list):
        r"""

        Sort intervals by start, then by end.

        Args:
            intervals (list[list[int]]): The intervals to sort.

        Returns:
            str: JSON list of the sorted intervals.

        Example Output:
            "[[1, 3], [2, 6]]"
        """
        return json.dumps(sorted([list(i) for i in intervals]))

    def Overlaps(self, first: list, second: list):
        r"""

        Tell whether the second interval starts before the first one ends (the first starts no later than the second).

        Args:
            first (list[int]): The earlier interval.
            second (list[int]): The later interval.

        Returns:
            str: "True" or "False".

        Example Output:
            "True"
        """
        return str(second[0] <= first[1])

    def MergeTwo(self, first: list, second: list):
        r"""

        Merge two overlapping intervals into one.

        Args:
            first (list[int]): First interval.
            second (list[int]): Second interval.

        Returns:
            str: JSON of the merged interval.

        Example Output:
            "[1, 6]"
        """
        return json.dumps([min(first[0], second[0]), max(first[1], second[1])])

    def Done(self, answer: list):
        r"""

        Submit the merged intervals and end the episode.

        Args:
            answer (list[list[int]]): The merged intervals sorted by start.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: [[1, 6], [8, 10]], Reference answer: [[1, 6], [8, 10]], Result: Correct, reward=1"
        """
        ref = self.get_ref_answer()
        correct = [list(i) for i in answer] == ref
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {answer}, Reference answer: {ref}, Result: {'Correct' if correct else 'Incorrect'}, reward={self._reward}"

    def solve(self):
        def call(name, **params):
            return self.step(json.dumps({"name": name, "parameters": params}))[1]

        ordered = json.loads(call("SortByStart", intervals=json.loads(call("Observe"))))
        merged = []
        for interval in ordered:
            if merged and call("Overlaps", first=merged[-1], second=interval) == "True":
                merged[-1] = json.loads(call("MergeTwo", first=merged[-1], second=interval))
            else:
                merged.append(interval)
        return call("Done", answer=merged)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = MergeIntervalsEnv.from_env_str('MergeIntervalsEnv@{"intervals": [[1, 3], [2, 6], [8, 10], [15, 18]]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = MergeIntervalsEnv.from_env_str('MergeIntervalsEnv@{"intervals": [[1, 4], [4, 5]]}')
    print(env.solve())
    print("step count:", env.step_count)
