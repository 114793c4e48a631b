import ast
import json
import math

import gymnasium


class ArrayGcdEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_ELEMENT = 1
        self.REMAINDER = 2
        self.IS_ZERO = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetElement": self.GET_ELEMENT,
            "Remainder": self.REMAINDER,
            "IsZero": self.IS_ZERO,
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
        if not env_str.startswith("ArrayGcdEnv@"):
            return None
        return ArrayGcdEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.nums = list(options.get("nums", []))
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        g = 0
        for value in self.nums:
            g = math.gcd(g, value)
        return g

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

        Get the number of elements in the array.

        Args:
            None

        Returns:
            str: The array length.

        Example Output:
            "3"
        """
        return str(len(self.nums))

    def GetElement(self, index: int):
        r"""

        Read one element of the array.

        Args:
            index (int): Zero-based position.

        Returns:
            str: The element.

        Example Output:
            "12"
        """
        if not 0 <= index < len(self.nums):
            return f"Error: index {index} out of range"
        return str(self.nums[index])

    def Remainder(self, a: int, b: int):
        r"""

        Compute a modulo b.

        Args:
            a (int): Dividend.
            b (int): Divisor, not zero.

        Returns:
            str: The remainder.

        Example Output:
            "6"
        """
        return str(a % b)

    def IsZero(self, value: int):
        r"""

        Tell whether a number is zero.

        Args:
            value (int): The number.

        Returns:
            str: "True" or "False".

        Example Output:
            "False"
        """
        return str(value == 0)

    def Done(self, answer: int):
        r"""

        Submit the greatest common divisor and end the episode.

        Args:
            answer (int): The greatest common divisor.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: 6, Reference answer: 6, Result: Correct, reward=1"
        """
        ref = self.get_ref_answer()
        correct = answer == ref
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {answer}, Reference answer: {ref}, Result: {'Correct' if correct else 'Incorrect'}, reward={self._reward}"

    def solve(self):
        def call(name, **params):
            return self.step(json.dumps({"name": name, "parameters": params}))[1]

        n = int(call("Observe"))
        g = int(call("GetElement", index=0))
        for i in range(1, n):
            b = int(call("GetElement", index=i))
            a = g
            while call("IsZero", value=b) == "False":
                a, b = b, int(call("Remainder", a=a, b=b))
            g = a
        return call("Done", answer=g)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = ArrayGcdEnv.from_env_str('ArrayGcdEnv@{"nums": [12, 18, 24]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = ArrayGcdEnv.from_env_str('ArrayGcdEnv@{"nums": [7, 13]}')
    print(env.solve())
    print("step count:", env.step_count)
