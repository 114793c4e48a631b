import ast
import json

import gymnasium


class PalindromeCheckEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_CHAR = 1
        self.IS_ALNUM = 2
        self.TO_LOWER = 3
        self.DONE = 4
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetChar": self.GET_CHAR,
            "IsAlnum": self.IS_ALNUM,
            "ToLower": self.TO_LOWER,
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
        if not env_str.startswith("PalindromeCheckEnv@"):
            return None
        return PalindromeCheckEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.s = str(options.get("s", ""))
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        cleaned = [c.lower() for c in self.s if c.isalnum()]
        return cleaned == cleaned[::-1]

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

        Get the length of the hidden string.

        Args:
            None

        Returns:
            str: The number of characters.

        Example Output:
            "11"
        """
        return str(len(self.s))

    def GetChar(self, index: int):
        r"""

        Read the character at a position of the string.

        Args:
            index (int): Zero-based position.

        Returns:
            str: The character, as JSON.

        Example Output:
            "\"a\""
        """
        if not 0 <= index < len(self.s):
            return f"Error: index {index} out of range"
        return json.dumps(self.s[index])

    def IsAlnum(self, char: str):
        r"""

        Tell whether a character is a letter or a digit.

        Args:
            char (str): A single character.

        Returns:
            str: "True" or "False".

        Example Output:
            "True"
        """
        return str(len(char) == 1 and char.isalnum())

    def ToLower(self, char: str):
        r"""

        Convert a character to lower case.

        Args:
            char (str): A single character.

        Returns:
            str: The lower-case character.

        Example Output:
            "a"
        """
        return char.lower()

    def Done(self, answer: bool):
        r"""

        Submit whether the string is a palindrome and end the episode.

        Args:
            answer (bool): True if the string is a palindrome, else False.

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
        chars = []
        for i in range(n):
            char = json.loads(call("GetChar", index=i))
            if call("IsAlnum", char=char) == "True":
                chars.append(call("ToLower", char=char))
        return call("Done", answer=chars == chars[::-1])


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = PalindromeCheckEnv.from_env_str('PalindromeCheckEnv@{"s": "A man, a plan, a canal: Panama"}')
    print(env.solve())
    print("step count:", env.step_count)
    env = PalindromeCheckEnv.from_env_str('PalindromeCheckEnv@{"s": "race a car"}')
    print(env.solve())
    print("step count:", env.step_count)
