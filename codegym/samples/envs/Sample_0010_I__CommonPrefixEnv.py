import ast
import json

import gymnasium


class CommonPrefixEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_WORD = 1
        self.COMMON_PREFIX = 2
        self.IS_EMPTY = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetWord": self.GET_WORD,
            "CommonPrefix": self.COMMON_PREFIX,
            "IsEmpty": self.IS_EMPTY,
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
        if not env_str.startswith("CommonPrefixEnv@"):
            return None
        return CommonPrefixEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.words = [str(w) for w in options.get("words", [])]
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        if not self.words:
            return ""
        prefix = self.words[0]
        for word in self.words[1:]:
            while not word.startswith(prefix):
                prefix = prefix[:-1]
        return prefix

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

        Get the number of words.

        Args:
            None

        Returns:
            str: The number of words.

        Example Output:
            "3"
        """
        return str(len(self.words))

    def GetWord(self, index: int):
        r"""

        Read one word.

        Args:
            index (int): Zero-based word index.

        Returns:
            str: The word.

        Example Output:
            "flower"
        """
        if not 0 <= index < len(self.words):
            return f"Error: index {index} out of range"
        return self.words[index]

    def CommonPrefix(self, first: str, second: str):
        r"""

        Longest common prefix of two strings.

        Args:
            first (str): First string.
            second (str): Second string.

        Returns:
            str: The common prefix, as JSON.

        Example Output:
            "\"fl\""
        """
        n = 0
        while n < min(len(first), len(second)) and first[n] == second[n]:
            n += 1
        return json.dumps(first[:n])

    def IsEmpty(self, text: str):
        r"""

        Tell whether a string is empty.

        Args:
            text (str): The string.

        Returns:
            str: "True" or "False".

        Example Output:
            "False"
        """
        return str(text == "")

    def Done(self, answer: str):
        r"""

        Submit the common prefix and end the episode.

        Args:
            answer (str): The longest common prefix.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: fl, Reference answer: fl, Result: Correct, reward=1"
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
        prefix = call("GetWord", index=0)
        for i in range(1, n):
            if call("IsEmpty", text=prefix) == "True":
                break
            prefix = json.loads(call("CommonPrefix", first=prefix, second=call("GetWord", index=i)))
        return call("Done", answer=prefix)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = CommonPrefixEnv.from_env_str('CommonPrefixEnv@{"words": ["flower", "flow", "flight"]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = CommonPrefixEnv.from_env_str('CommonPrefixEnv@{"words": ["dog", "racecar", "car"]}')
    print(env.solve())
    print("step count:", env.step_count)
