import ast
import json

import gymnasium


class TwoSumEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_ELEMENT = 1
        self.SUBTRACT = 2
        self.RECORD = 3
        self.LOOKUP = 4
        self.DONE = 5
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetElement": self.GET_ELEMENT,
            "Subtract": self.SUBTRACT,
            "Record": self.RECORD,
            "Lookup": self.LOOKUP,
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
        if not env_str.startswith("TwoSumEnv@"):
            return None
        return TwoSumEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.nums = list(options.get("nums", []))
        self.target = int(options.get("target", 0))
        self.seen = {}
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        seen = {}
        for i, x in enumerate(self.nums):
            if self.target - x in seen:
                return [seen[self.target - x], i]
            seen[x] = i
        return []

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

        Get the array length and the target sum.

        Args:
            None

        Returns:
            str: JSON object with "length" and "target".

        Example Output:
            "{\"length\": 4, \"target\": 9}"
        """
        return json.dumps({"length": len(self.nums), "target": self.target})

    def GetElement(self, index: int):
        r"""

        Read one element of the array.

        Args:
            index (int): Zero-based position.

        Returns:
            str: The element.

        Example Output:
            "7"
        """
        if not 0 <= index < len(self.nums):
            return f"Error: index {index} out of range"
        return str(self.nums[index])

    def Subtract(self, a: int, b: int):
        r"""

        Compute a minus b.

        Args:
            a (int): Minuend.
            b (int): Subtrahend.

        Returns:
            str: The difference.

        Example Output:
            "2"
        """
        return str(a - b)

    def Record(self, value: int, index: int):
        r"""

        Remember that a value was seen at an index.

        Args:
            value (int): The value.
            index (int): Where it was seen.

        Returns:
            str: Number of values remembered.

        Example Output:
            "3"
        """
        self.seen.setdefault(value, index)
        return str(len(self.seen))

    def Lookup(self, value: int):
        r"""

        Find where a remembered value was seen.

        Args:
            value (int): The value to look up.

        Returns:
            str: The index, or "-1" when the value was not remembered.

        Example Output:
            "0"
        """
        return str(self.seen.get(value, -1))

    def Done(self, answer: list):
        r"""

        Submit the two indices and end the episode.

        Args:
            answer (list[int]): The two indices in increasing order.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: [0, 1], Reference answer: [0, 1], Result: Correct, reward=1"
        """
        ref = self.get_ref_answer()
        correct = list(answer) == ref
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {answer}, Reference answer: {ref}, Result: {'Correct' if correct else 'Incorrect'}, reward={self._reward}"

    def solve(self):
        def call(name, **params):
            return self.step(json.dumps({"name": name, "parameters": params}))[1]

        info = json.loads(call("Observe"))
        for i in range(info["length"]):
            value = int(call("GetElement", index=i))
            j = int(call("Lookup", value=int(call("Subtract", a=info["target"], b=value))))
            if j >= 0:
                return call("Done", answer=[j, i])
            call("Record", value=value, index=i)
        return call("Done", answer=[])


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = TwoSumEnv.from_env_str('TwoSumEnv@{"nums": [2, 7, 11, 15], "target": 9}')
    print(env.solve())
    print("step count:", env.step_count)
    env = TwoSumEnv.from_env_str('TwoSumEnv@{"nums": [3, 2, 4], "target": 6}')
    print(env.solve())
    print("step count:", env.step_count)
