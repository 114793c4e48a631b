import ast
import json
from collections import deque

import gymnasium


class TicketQueueEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.FRONT_PERSON = 1
        self.SERVE_FRONT = 2
        self.GET_ELAPSED = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "FrontPerson": self.FRONT_PERSON,
            "ServeFront": self.SERVE_FRONT,
            "GetElapsed": self.GET_ELAPSED,
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
        if not env_str.startswith("TicketQueueEnv@"):
            return None
        return TicketQueueEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.tickets = list(options.get("tickets", []))
        self.k = int(options.get("k", 0))
        self.queue = deque((i, t) for i, t in enumerate(self.tickets))
        self.elapsed = 0
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        total = 0
        for i, t in enumerate(self.tickets):
            total += min(t, self.tickets[self.k]) if i <= self.k else min(t, self.tickets[self.k] - 1)
        return total

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

        Get the position of the person being tracked and the queue length.

        Args:
            None

        Returns:
            str: JSON object with "k" and "queue_length".

        Example Output:
            "{\"k\": 2, \"queue_length\": 3}"
        """
        return json.dumps({"k": self.k, "queue_length": len(self.queue)})

    def FrontPerson(self):
        r"""

        Look at the person at the front of the queue.

        Args:
            None

        Returns:
            str: JSON object with the person's original "position" and "remaining" tickets, or "Empty".

        Example Output:
            "{\"position\": 0, \"remaining\": 2}"
        """
        if not self.queue:
            return "Empty"
        position, remaining = self.queue[0]
        return json.dumps({"position": position, "remaining": remaining})

    def ServeFront(self):
        r"""

        Sell one ticket to the front person (one second passes); they rejoin the back unless done.

        Args:
            None

        Returns:
            str: JSON object with the served "position", their "remaining" tickets and whether they "left".

        Example Output:
            "{\"position\": 0, \"remaining\": 1, \"left\": false}"
        """
        if not self.queue:
            return "Error: the queue is empty"
        position, remaining = self.queue.popleft()
        remaining -= 1
        self.elapsed += 1
        if remaining > 0:
            self.queue.append((position, remaining))
        return json.dumps({"position": position, "remaining": remaining, "left": remaining == 0})

    def GetElapsed(self):
        r"""

        Get the number of seconds that have passed.

        Args:
            None

        Returns:
            str: Elapsed seconds.

        Example Output:
            "6"
        """
        return str(self.elapsed)

    def Done(self, answer: int):
        r"""

        Submit the number of seconds and end the episode.

        Args:
            answer (int): Seconds until the tracked person is done.

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

        k = json.loads(call("Observe"))["k"]
        while True:
            served = json.loads(call("ServeFront"))
            if served["position"] == k and served["left"]:
                break
        return call("Done", answer=int(call("GetElapsed")))


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = TicketQueueEnv.from_env_str('TicketQueueEnv@{"tickets": [2, 3, 2], "k": 2}')
    print(env.solve())
    print("step count:", env.step_count)
    env = TicketQueueEnv.from_env_str('TicketQueueEnv@{"tickets": [5, 1, 1, 1], "k": 0}')
    print(env.solve())
    print("step count:", env.step_count)
