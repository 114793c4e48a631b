import ast
import json

import gymnasium


class SearchInsertEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.MIDPOINT = 1
        self.GET_ELEMENT = 2
        self.IS_LESS = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "Midpoint": self.MIDPOINT,
            "GetElement": self.GET_ELEMENT,
            "IsLess": self.IS_LESS,
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
        if not env_str.startswith("SearchInsertEnv@"):
            return None
        return SearchInsertEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.nums = list(options.get("nums", []))
        self.target = int(options.get("target", 0))
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        lo, hi = 0, len(self.nums)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.nums[mid] < self.target:
                lo = mid + 1
            else:
                hi = mid
        return lo

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

        Get the array length and the target.

        Args:
            None

        Returns:
            str: JSON object with "length" and "target".

        Example Output:
            "{\"length\": 4, \"target\": 5}"
        """
        return json.dumps({"length": len(self.nums), "target": self.target})

    def Midpoint(self, lo: int, hi: int):
        r"""

        Middle index of a half-open range, rounded down.

        Args:
            lo (int): Start of the range.
            hi (int): End of the range (exclusive).

        Returns:
            str: (lo + hi) // 2.

        Example Output:
            "2"
        """
        return str((lo + hi) // 2)

    def GetElement(self, index: int):
        r"""

        Read one element of the array.

        Args:
            index (int): Zero-based position.

        Returns:
            str: The element.

        Example Output:
            "5"
        """
        if not 0 <= index < len(self.nums):
            return f"Error: index {index} out of range"
        return str(self.nums[index])

    def IsLess(self, a: int, b: int):
        r"""

        Tell whether a is less than b.

        Args:
            a (int): First number.
            b (int): Second number.

        Returns:
            str: "True" or "False".

        Example Output:
            "True"
        """
        return str(a < b)

    def Done(self, answer: int):
        r"""

        Submit the index and end the episode.

        Args:
            answer (int): The index of the target or its insertion point.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: 2, Reference answer: 2, Result: Correct, reward=1"
        """
        ref = self.get_ref_answer()
        correct = answer == ref
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {answer}, Reference answer: {ref}, Result: {'Correct' if correct else 'Incorrect'}, reward={self._reward}"

    def solve(self):
        def call(name, **params):
            return self.step(json.dumps({"name": name, "parameters": params}))[1]

        info = json.loads(call("Observe"))
        lo, hi = 0, info["length"]
        while lo < hi:
            mid = int(call("Midpoint", lo=lo, hi=hi))
            if call("IsLess", a=int(call("GetElement", index=mid)), b=info["target"]) == "True":
                lo = mid + 1
            else:
                hi = mid
        return call("Done", answer=lo)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = SearchInsertEnv.from_env_str('SearchInsertEnv@{"nums": [1, 3, 5, 6], "target": 5}')
    print(env.solve())
    print("step count:", env.step_count)
    env = SearchInsertEnv.from_env_str('SearchInsertEnv@{"nums": [1, 3, 5, 6], "target": 2}')
    print(env.solve())
    print("step count:", env.step_count)
