import ast
import json

import gymnasium


class MinCostStairsEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_COST = 1
        self.ADD = 2
        self.MIN_OF_TWO = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetCost": self.GET_COST,
            "Add": self.ADD,
            "MinOfTwo": self.MIN_OF_TWO,
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
        if not env_str.startswith("MinCostStairsEnv@"):
            return None
        return MinCostStairsEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.cost = list(options.get("cost", []))
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        a, b = 0, 0
        for i in range(2, len(self.cost) + 1):
            a, b = b, min(b + self.cost[i - 1], a + self.cost[i - 2])
        return b

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

        Get the number of steps of the staircase.

        Args:
            None

        Returns:
            str: The number of steps.

        Example Output:
            "3"
        """
        return str(len(self.cost))

    def GetCost(self, index: int):
        r"""

        Read the cost of one step.

        Args:
            index (int): Zero-based step index.

        Returns:
            str: The cost of the step.

        Example Output:
            "15"
        """
        if not 0 <= index < len(self.cost):
            return f"Error: index {index} out of range"
        return str(self.cost[index])

    def Add(self, a: int, b: int):
        r"""

        Add two numbers.

        Args:
            a (int): First number.
            b (int): Second number.

        Returns:
            str: The sum.

        Example Output:
            "25"
        """
        return str(a + b)

    def MinOfTwo(self, a: int, b: int):
        r"""

        Return the smaller of two numbers.

        Args:
            a (int): First number.
            b (int): Second number.

        Returns:
            str: The minimum.

        Example Output:
            "10"
        """
        return str(min(a, b))

    def Done(self, answer: int):
        r"""

        Submit the minimum cost and end the episode.

        Args:
            answer (int): The minimum total cost.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: 15, Reference answer: 15, Result: Correct, reward=1"
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
        a, b = 0, 0
        for i in range(2, n + 1):
            one = int(call("Add", a=b, b=int(call("GetCost", index=i - 1))))
            two = int(call("Add", a=a, b=int(call("GetCost", index=i - 2))))
            a, b = b, int(call("MinOfTwo", a=one, b=two))
        return call("Done", answer=b)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = MinCostStairsEnv.from_env_str('MinCostStairsEnv@{"cost": [10, 15, 20]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = MinCostStairsEnv.from_env_str('MinCostStairsEnv@{"cost": [1, 100, 1, 1, 1, 100, 1, 1, 100, 1]}')
    print(env.solve())
    print("step count:", env.step_count)
