import ast
import json

import gymnasium


class CoinChangeEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_BEST = 1
        self.SET_BEST = 2
        self.MIN_CANDIDATE = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetBest": self.GET_BEST,
            "SetBest": self.SET_BEST,
            "MinCandidate": self.MIN_CANDIDATE,
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
        if not env_str.startswith("CoinChangeEnv@"):
            return None
        return CoinChangeEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.coins = list(options.get("coins", []))
        self.amount = int(options.get("amount", 0))
        self.table = {0: 0}
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        best = [0] + [None] * self.amount
        for a in range(1, self.amount + 1):
            options = [best[a - c] + 1 for c in self.coins if c <= a and best[a - c] is not None]
            best[a] = min(options) if options else None
        return best[self.amount] if best[self.amount] is not None else -1

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

        Get the coin denominations and the target amount.

        Args:
            None

        Returns:
            str: JSON object with "coins" and "amount".

        Example Output:
            "{\"coins\": [1, 2, 5], \"amount\": 11}"
        """
        return json.dumps({"coins": self.coins, "amount": self.amount})

    def GetBest(self, amount: int):
        r"""

        Read the fewest coins recorded for an amount.

        Args:
            amount (int): The amount.

        Returns:
            str: The recorded count, or "-1" when none is recorded (amount 0 is recorded as 0).

        Example Output:
            "2"
        """
        return str(self.table.get(amount, -1))

    def SetBest(self, amount: int, count: int):
        r"""

        Record the fewest coins for an amount.

        Args:
            amount (int): The amount.
            count (int): Fewest coins found, or -1 for impossible.

        Returns:
            str: Confirmation.

        Example Output:
            "best[11] = 3"
        """
        if count >= 0:
            self.table[amount] = count
        return f"best[{amount}] = {count}"

    def MinCandidate(self, current: int, candidate: int):
        r"""

        Combine a current best count with a candidate count, where -1 means impossible.

        Args:
            current (int): Current best, or -1.
            candidate (int): Candidate count, or -1.

        Returns:
            str: The better count, or -1 if both are impossible.

        Example Output:
            "3"
        """
        values = [v for v in (current, candidate) if v >= 0]
        return str(min(values) if values else -1)

    def Done(self, answer: int):
        r"""

        Submit the fewest number of coins and end the episode.

        Args:
            answer (int): Fewest coins, or -1.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: 3, Reference answer: 3, Result: Correct, reward=1"
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
        for a in range(1, info["amount"] + 1):
            best = -1
            for c in info["coins"]:
                if c <= a:
                    prev = int(call("GetBest", amount=a - c))
                    if prev >= 0:
                        best = int(call("MinCandidate", current=best, candidate=prev + 1))
            call("SetBest", amount=a, count=best)
        return call("Done", answer=int(call("GetBest", amount=info["amount"])))


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = CoinChangeEnv.from_env_str('CoinChangeEnv@{"coins": [1, 2, 5], "amount": 11}')
    print(env.solve())
    print("step count:", env.step_count)
    env = CoinChangeEnv.from_env_str('CoinChangeEnv@{"coins": [2], "amount": 3}')
    print(env.solve())
    print("step count:", env.step_count)
