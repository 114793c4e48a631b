import ast
import json

import gymnasium


class JumpGameEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_JUMP = 1
        self.EXTEND_REACH = 2
        self.IS_REACHABLE = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetJump": self.GET_JUMP,
            "ExtendReach": self.EXTEND_REACH,
            "IsReachable": self.IS_REACHABLE,
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
        if not env_str.startswith("JumpGameEnv@"):
            return None
        return JumpGameEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.nums = list(options.get("nums", []))
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        reach = 0
        for i, jump in enumerate(self.nums):
            if i > reach:
                return False
            reach = max(reach, i + jump)
        return True

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

        Get the number of cells.

        Args:
            None

        Returns:
            str: The number of cells.

        Example Output:
            "5"
        """
        return str(len(self.nums))

    def GetJump(self, index: int):
        r"""

        Read the maximum jump length of a cell.

        Args:
            index (int): Zero-based cell index.

        Returns:
            str: The jump length.

        Example Output:
            "2"
        """
        if not 0 <= index < len(self.nums):
            return f"Error: index {index} out of range"
        return str(self.nums[index])

    def ExtendReach(self, reach: int, index: int, jump: int):
        r"""

        Furthest index reachable after also considering a jump from a cell.

        Args:
            reach (int): Furthest index reachable so far.
            index (int): The cell index.
            jump (int): The cell's jump length.

        Returns:
            str: The new furthest reachable index.

        Example Output:
            "4"
        """
        return str(max(reach, index + jump))

    def IsReachable(self, index: int, reach: int):
        r"""

        Tell whether a cell is within the furthest reachable index.

        Args:
            index (int): The cell index.
            reach (int): Furthest index reachable so far.

        Returns:
            str: "True" or "False".

        Example Output:
            "True"
        """
        return str(index <= reach)

    def Done(self, answer: bool):
        r"""

        Submit whether the last cell is reachable and end the episode.

        Args:
            answer (bool): True if the last cell can be reached.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: True, Reference answer: True, Result: Correct, reward=1"
        """
        ref = self.get_ref_answer()
        correct = answer is ref
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {answer}, Reference answer: {ref}, Result: {'Correct' if correct else 'Incorrect'}, reward={self._reward}"

    def solve(self):
        def call(name, **params):
            return self.step(json.dumps({"name": name, "parameters": params}))[1]

        n = int(call("Observe"))
        reach = 0
        for i in range(n):
            if call("IsReachable", index=i, reach=reach) == "False":
                return call("Done", answer=False)
            reach = int(call("ExtendReach", reach=reach, index=i, jump=int(call("GetJump", index=i))))
        return call("Done", answer=True)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = JumpGameEnv.from_env_str('JumpGameEnv@{"nums": [2, 3, 1, 1, 4]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = JumpGameEnv.from_env_str('JumpGameEnv@{"nums": [3, 2, 1, 0, 4]}')
    print(env.solve())
    print("step count:", env.step_count)
