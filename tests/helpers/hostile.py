"""A hostile environment: a valid `gymnasium.Env` whose `Evil` tool runs whatever body a test gives it.

`hostile(body, preamble)` is its source; the sandbox and resident-session tests build their
attacks on it (`HOSTILE_TEMPLATE` is the text with `{preamble}` and `{body}` left to fill).
"""

from __future__ import annotations

HOSTILE_TEMPLATE = """
import json
import gymnasium
{preamble}

class HostileEnv(gymnasium.Env):
    def __init__(self, env_str=None):
        super().__init__()
        self.func_mapping = {{"Observe": 0, "Evil": 1, "Done": 2}}
        self.reset({{}})

    @property
    def finished(self):
        return self._done

    @property
    def reward(self):
        return float(self._reward)

    @staticmethod
    def from_env_str(env_str):
        return HostileEnv(env_str)

    def reset(self, options=None):
        self._done, self._reward, self.step_count = False, 0, 0
        return "reset"

    def get_ref_answer(self):
        return 1

    def step(self, action):
        self.step_count += 1
        call = json.loads(action)
        return True, getattr(self, call["name"])(**call["parameters"])

    def Observe(self):
        return "ok"

    def Evil(self):
{body}
        return "survived"

    def Done(self, answer):
        self._done = True
        return "done"
"""


def hostile(body: str, preamble: str = "") -> str:
    indented = "\n".join("        " + line for line in body.strip("\n").splitlines())
    return HOSTILE_TEMPLATE.format(preamble=preamble, body=indented)
