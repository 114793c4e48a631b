"""What a forked child does with one request: untrusted code runs only here.

A child loads the environment's compiled source into a fresh module, runs the operation (create,
step, reset, ref_answer, solve, run_script, call_function) with its output captured and capped,
and reports a result; failures of the environment's code are results with a status, never
exceptions that reach the zygote. A resident session's process runs its later steps here too.
"""

import builtins
import contextlib
import io
import json
import marshal
import pickle
import resource
import sys
import time
import traceback
import types
from typing import Any

from . import frames
from .messages import Blob, Request, Result
from .values import ConfigError, canonical, parse_config

MODULE_NAME = "__codegym_env__"
STATE_MAGIC = b"CGS1"
# Bound before any env code runs: a request that monkeypatches builtins cannot corrupt the report
# of its own result (`frames` binds its JSON encoder at import, before any env code too).
_pack = frames.pack
BUILTINS = dict(builtins.__dict__)


class OutputLimitExceeded(BaseException):
    """Raised from print() past the output cap; a BaseException so env code rarely swallows it."""


class StepCapReached(BaseException):
    """Raised from step() when a solve() exceeds its step cap."""


class BadRequest(Exception):
    """The request cannot be served as asked (bad config, foreign state, no env class...)."""


class CappedWriter(io.TextIOBase):
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: list[str] = []
        self.size = 0
        self.truncated = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.cap - self.size
        if len(text) > room:
            self.parts.append(text[: max(room, 0)])
            self.size = self.cap
            self.truncated = True
            raise OutputLimitExceeded(f"output exceeded {self.cap} bytes")
        self.parts.append(text)
        self.size += len(text)
        return len(text)

    def getvalue(self) -> str:
        return "".join(self.parts)


class Child:
    """Everything that happens in the forked process: untrusted code runs only here."""

    def __init__(self, req: Request, code: types.CodeType) -> None:
        self.req = req
        self.code = code
        self.stdout = CappedWriter(req["limits"]["output_bytes"])
        self.stderr = CappedWriter(req["limits"]["output_bytes"])
        self.module: Any = None
        # The live session of a step request, kept when this process stays resident.
        self.env: Any = None
        self.config: dict[str, Any] = {}

    def next_request(self, req: Request) -> None:
        """A resident child's next step: fresh output capture, same module and env."""
        self.req = req
        self.stdout = CappedWriter(req["limits"]["output_bytes"])
        self.stderr = CappedWriter(req["limits"]["output_bytes"])

    def step_env(self, action: str, result: Result) -> None:
        out = self.env.step(action)
        observation = out[1] if isinstance(out, tuple) and len(out) == 2 else out
        result["observation"] = str(observation)
        result["state"] = self.pack_state(self.env, self.config)
        self.episode(self.env, result)

    def load_module(self, as_main: bool = False) -> types.ModuleType:
        module = types.ModuleType("__main__" if as_main else MODULE_NAME)
        module.__file__ = "<env>"
        module.__dict__["__builtins__"] = builtins
        if not as_main:
            sys.modules[MODULE_NAME] = module
        exec(self.code, module.__dict__)
        self.module = module
        return module

    def env_class(self) -> Any:
        import gymnasium

        found = [
            v
            for v in vars(self.module).values()
            if isinstance(v, type) and issubclass(v, gymnasium.Env) and v.__module__ == self.module.__name__
        ]
        if len(found) != 1:
            raise BadRequest(f"expected exactly one gymnasium.Env subclass in the source, found {len(found)}")
        return found[0]

    def make_env(self, config: dict[str, Any]) -> tuple[Any, Any]:
        cls = self.env_class()
        env = cls.from_env_str(cls.__name__ + "@" + json.dumps(config))
        if env is None:
            raise BadRequest(f"{cls.__name__}.from_env_str refused its own env string")
        observation = env.reset(config)
        return env, observation

    def pack_state(self, env: Any, config: dict[str, Any]) -> bytes:
        return STATE_MAGIC + bytes.fromhex(self.req["sha"]) + pickle.dumps((config, env), protocol=5)

    def unpack_state(self) -> tuple[dict[str, Any], Any]:
        blob: Blob = self.req.get("state") or b""
        if blob[:4] != STATE_MAGIC:
            raise BadRequest("state is not an environment state")
        if blob[4:36] != bytes.fromhex(self.req["sha"]):
            raise BadRequest("state belongs to another environment source")
        try:
            return pickle.loads(blob[36:])
        except Exception as exc:
            raise BadRequest(f"state cannot be restored: {type(exc).__name__}: {exc}") from None

    def episode(self, env: Any, result: Result) -> None:
        result["reward"] = float(getattr(env, "reward", 0.0) or 0.0)
        result["done"] = bool(getattr(env, "finished", False))
        result["step_count"] = int(getattr(env, "step_count", 0) or 0)

    def run(self) -> Result:
        req = self.req
        op = req["op"]
        result: Result = {"status": "ok"}
        if op == "run_script":
            return self.run_script(result)
        self.load_module()
        if op != "call_function":
            result["env_class"] = self.env_class().__name__
        if op == "create":
            self.config = config_of(req)
            self.env, observation = self.make_env(self.config)
            result["observation"] = str(observation)
            result["state"] = self.pack_state(self.env, self.config)
            self.episode(self.env, result)
        elif op == "step":
            self.config, self.env = self.unpack_state()
            self.step_env(req.get("action", ""), result)
        elif op == "reset":
            config, env = self.unpack_state()
            if req.get("config"):
                config = config_of(req)
            result["observation"] = str(env.reset(config))
            result["state"] = self.pack_state(env, config)
            self.episode(env, result)
        elif op == "ref_answer":
            import tracemalloc

            env, _ = self.make_env(config_of(req))
            tracemalloc.start()
            answer = env.get_ref_answer()
            result["peak_alloc_bytes"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            self.answer(answer, result)
        elif op == "solve":
            self.solve(result)
        elif op == "call_function":
            fn = getattr(self.module, req.get("function", ""), None)
            if not callable(fn):
                raise BadRequest(f"the source has no function {req.get('function')!r}")
            sys.stdin = io.StringIO(req.get("stdin", ""))
            self.answer(fn(*req.get("args", []), **req.get("kwargs", {})), result)
        else:
            raise BadRequest(f"unknown operation {op!r}")
        return result

    def answer(self, value: Any, result: Result) -> None:
        result["answer_repr"] = repr(value)[:4096]
        try:
            result["answer_json"] = json.dumps(canonical(value), sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            result["answer_json"] = ""

    def solve(self, result: Result) -> None:
        req = self.req
        config = config_of(req)
        cls = self.env_class()
        if req.get("solve_source"):
            namespace = dict(vars(self.module))
            exec(compile(req["solve_source"], "<solve>", "exec"), namespace)
            fn = namespace.get("solve")
            if not callable(fn):
                raise BadRequest("solve_source does not define solve(self)")
            cls.solve = fn
        env, first = self.make_env(config)
        cap = req.get("max_steps") or 256
        trajectory: list[str] | None = [str(first)] if req.get("record") else None
        original_step = env.step
        calls = [0]

        def capped_step(action: str) -> Any:
            calls[0] += 1
            if calls[0] > cap:
                raise StepCapReached(f"solve() exceeded {cap} steps")
            out = original_step(action)
            if trajectory is not None:
                observation = out[1] if isinstance(out, tuple) and len(out) == 2 else out
                trajectory.extend((str(action), str(observation)))
            return out

        env.step = capped_step
        try:
            result["observation"] = str(env.solve())
        except StepCapReached as exc:
            result["message"] = str(exc)
        if trajectory is not None:
            result["trajectory"] = trajectory
        self.episode(env, result)

    def run_script(self, result: Result) -> Result:
        sys.stdin = io.StringIO(self.req.get("stdin", ""))
        code = 0
        try:
            self.load_module(as_main=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except OutputLimitExceeded:
            raise
        except BaseException:
            traceback.print_exc()
            code = 1
        result["exit_code"] = code
        if code != 0:
            result["status"] = "env_error"
            result["message"] = f"script exited with code {code}"
        return result


def warm_up() -> None:
    """Run, before the request arrives, the code paths every request runs.

    After fork each first write to a page copies it; most of those writes are reference counts of
    the interpreter's own objects (json, pickle, the frames' code, gymnasium's classes). Taking
    those copies while the spare child waits keeps them off the request's latency.
    """
    import gymnasium

    state = pickle.dumps(({"k": [1, "a"]}, gymnasium.Env()), protocol=5)
    frame = frames.encode({"status": "ok", "state": state, "observation": "x", "usage": {"wall_ms": 0}})
    config, env = pickle.loads(frames.decode(frame)["state"])
    CappedWriter(64).write(str(config) + str(env))
    resource.getrusage(resource.RUSAGE_SELF)


def run_request(req: Request, child: "Child | None") -> tuple[Result, "Child | None"]:
    """Serve one request in this process (a fresh `Child`, or the resident one for its next step)."""
    import random

    started = time.monotonic()
    cpu_before = cpu_seconds()
    random.seed(req.get("seed", 0))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(req.get("seed", 0) % 2**32)
    try:
        if child is None:
            if not req.get("code"):
                raise BadRequest("no compiled code in the request")
            # Compiled by the zygote, which keeps it marshalled (`codecache`).
            child = Child(req, marshal.loads(req["code"]))
            sys.stdout, sys.stderr = child.stdout, child.stderr
            result = child.run()
        else:
            child.next_request(req)
            sys.stdout, sys.stderr = child.stdout, child.stderr
            result = {"status": "ok"}
            child.step_env(req.get("action", ""), result)
    except OutputLimitExceeded as exc:
        result = {"status": "output_limit", "message": str(exc)}
    except MemoryError:
        result = {"status": "memory_limit", "message": "memory limit exceeded (MemoryError)"}
    except RecursionError as exc:
        result = {"status": "env_error", "message": f"RecursionError: {exc}"}
    except BadRequest as exc:
        result = {"status": "bad_request", "message": str(exc)}
    except SystemExit as exc:
        result = {"status": "env_error", "message": f"environment called exit({exc.code!r})"}
    except BaseException as exc:
        with contextlib.suppress(OutputLimitExceeded):
            traceback.print_exc()
        result = {"status": "env_error", "message": f"{type(exc).__name__}: {exc}"[:2000]}
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    builtins.__dict__.update(BUILTINS)
    if child is not None:
        result["stdout"] = child.stdout.getvalue()
        result["stderr"] = child.stderr.getvalue()
        result["output_truncated"] = child.stdout.truncated or child.stderr.truncated
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["usage"] = {
        "wall_ms": int((time.monotonic() - started) * 1000),
        "cpu_ms": int((usage.ru_utime + usage.ru_stime - cpu_before) * 1000),
        "peak_rss_kb": usage.ru_maxrss,
        "peak_alloc_bytes": result.pop("peak_alloc_bytes", 0),
    }
    return result, child


def config_of(req: Request) -> dict[str, Any]:
    """The request's task config ({} when it carries none), read by the one rule of `values`."""
    text = req.get("config") or ""
    if not text:
        return {}
    try:
        return parse_config(text)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def result_frame(result: Result) -> list[Blob]:
    """A result as its frame's chunks (`frames.pack`); one JSON cannot hold is an env_error."""
    try:
        return _pack(result)
    except (TypeError, ValueError) as exc:
        return _pack({"status": "env_error", "message": f"result not serializable: {exc}"})
