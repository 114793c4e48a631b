import ast
import json

import gymnasium


class MaxSubarraySumEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_ELEMENT = 1
        self.EXTEND_OR_RESTART = 2
        self.UPDATE_BEST = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetElement": self.GET_ELEMENT,
            "ExtendOrRestart": self.EXTEND_OR_RESTART,
            "UpdateBest": self.UPDATE_BEST,
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
        if not env_str.startswith("MaxSubarraySumEnv@"):
            return None
        return MaxSubarraySumEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.nums = list(options.get("nums", []))
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        best = current = self.nums[0]
        for value in self.nums[1:]:
            current = max(value, current + value)
            best = max(best, current)
        return best

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

        Get the number of elements in the hidden array.

        Args:
            None

        Returns:
            str: The array length.

        Example Output:
            "5"
        """
        return str(len(self.nums))

    def GetElement(self, index: int):
        r"""

        Read one element of the array.

        Args:
            index (int): Zero-based position of the element.

        Returns:
            str: The element value.

        Example Output:
            "-3"
        """
        if not 0 <= index < len(self.nums):
            return f"Error: index {index} out of range"
        return str(self.nums[index])

    def ExtendOrRestart(self, current: int, value: int):
        r"""

        Best sum of a subarray ending at the current element: either extend the running sum with the value or start again from the value.

        Args:
            current (int): Best sum of a subarray ending at the previous element.
            value (int): The current element.

        Returns:
            str: The larger of value and current + value.

        Example Output:
            "7"
        """
        return str(max(value, current + value))

    def UpdateBest(self, best: int, candidate: int):
        r"""

        Keep the larger of the best sum so far and a candidate sum.

        Args:
            best (int): Best sum seen so far.
            candidate (int): A new candidate sum.

        Returns:
            str: The new best sum.

        Example Output:
            "9"
        """
        return str(max(best, candidate))

    def Done(self, answer: int):
        r"""

        Submit the maximum subarray sum and end the episode.

        Args:
            answer (int): The submitted maximum sum.

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
        current = best = int(call("GetElement", index=0))
        for i in range(1, n):
            value = int(call("GetElement", index=i))
            current = int(call("ExtendOrRestart", current=current, value=value))
            best = int(call("UpdateBest", best=best, candidate=current))
        return call("Done", answer=best)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = MaxSubarraySumEnv.from_env_str('MaxSubarraySumEnv@{"nums": [-2, 1, -3, 4, -1, 2, 1, -5, 4]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = MaxSubarraySumEnv.from_env_str('MaxSubarraySumEnv@{"nums": [-3, -1, -2]}')
    print(env.solve())
    print("step count:", env.step_count)
