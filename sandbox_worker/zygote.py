"""The zygote: the long-lived process inside a jail that forks one child per request.

This file runs *inside* nsjail and is mounted there on its own, so it imports only the standard
library and what environments use (gymnasium); never the project's packages. It talks to the
trusted worker over its stdin/stdout with length-prefixed JSON frames, and answers one request at
a time: after each request every other process in the jail is killed (the zygote is pid 1 of the
jail's pid namespace, so `kill(-1)` reaches exactly the leftovers), so nothing a request starts
outlives it and nothing leaks into the next one.
"""

import base64
import builtins
import collections
import contextlib
import gc
import hashlib
import io
import json
import os
import pickle
import resource
import select
import signal
import struct
import sys
import time
import traceback
import types
from collections.abc import Mapping
from typing import Any

# resident.py is mounted beside this file; -P keeps the script's folder off sys.path, so say it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resident

PRELOAD = (
    "gymnasium",
    "numpy",
    "ast",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
)
MODULE_NAME = "__codegym_env__"
STATE_MAGIC = b"CGS1"
MAX_RESULT_BYTES = 32 * 1024 * 1024
CODE_CACHE_SIZE = 128
HEADER = struct.Struct(">I")
# Resident sessions per jail, and how long one may sit idle; the worker may send its own values.
RESIDENT_CAP = 64
RESIDENT_IDLE_S = 300.0
# A resident session idle this long may give its place to a new one when the jail is full.
ADMIT_IDLE_S = 2.0
# Highest fd a forked child may have inherited (the jail's RLIMIT_NOFILE is below it).
MAX_FDS = 1024
# Bound before any env code runs: a request that monkeypatches json or builtins cannot corrupt
# the report of its own result.
_dumps = json.JSONEncoder(separators=(",", ":")).encode


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


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def encode_frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def send_frame(fd: int, obj: dict[str, Any]) -> None:
    write_all(fd, encode_frame(obj))


def canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if type(value).__module__ == "numpy":
        return canonical(value.tolist())
    raise TypeError(type(value).__name__)


def parse_config(text: str | None) -> dict[str, Any]:
    import ast

    if not text or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise BadRequest("config is neither JSON nor a Python literal") from None
    if not isinstance(value, dict):
        raise BadRequest(f"config must be an object, got {type(value).__name__}")
    return value


class Child:
    """Everything that happens in the forked process: untrusted code runs only here."""

    def __init__(self, req: dict[str, Any], code: types.CodeType) -> None:
        self.req = req
        self.code = code
        self.stdout = CappedWriter(req["limits"]["output_bytes"])
        self.stderr = CappedWriter(req["limits"]["output_bytes"])
        self.module: Any = None
        # The live session of a step request, kept when this process stays resident.
        self.env: Any = None
        self.config: dict[str, Any] = {}

    def next_request(self, req: dict[str, Any]) -> None:
        """A resident child's next step: fresh output capture, same module and env."""
        self.req = req
        self.stdout = CappedWriter(req["limits"]["output_bytes"])
        self.stderr = CappedWriter(req["limits"]["output_bytes"])

    def step_env(self, action: str, result: dict[str, Any]) -> None:
        out = self.env.step(action)
        observation = out[1] if isinstance(out, tuple) and len(out) == 2 else out
        result["observation"] = str(observation)
        state = self.pack_state(self.env, self.config)
        result["state"] = state
        if self.req.get("resident"):
            result["state_sha"] = hashlib.sha256(state).hexdigest()
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
        blob = base64.b64decode(self.req.get("state") or "")
        if blob[:4] != STATE_MAGIC:
            raise BadRequest("state is not an environment state")
        if blob[4:36] != bytes.fromhex(self.req["sha"]):
            raise BadRequest("state belongs to another environment source")
        try:
            return pickle.loads(blob[36:])
        except Exception as exc:
            raise BadRequest(f"state cannot be restored: {type(exc).__name__}: {exc}") from None

    def episode(self, env: Any, result: dict[str, Any]) -> None:
        result["reward"] = float(getattr(env, "reward", 0.0) or 0.0)
        result["done"] = bool(getattr(env, "finished", False))
        result["step_count"] = int(getattr(env, "step_count", 0) or 0)

    def run(self) -> dict[str, Any]:
        req = self.req
        op = req["op"]
        result: dict[str, Any] = {"status": "ok"}
        if op == "run_script":
            return self.run_script(result)
        self.load_module()
        if op != "call_function":
            result["env_class"] = self.env_class().__name__
        if op == "create":
            self.config = parse_config(req.get("config"))
            self.env, observation = self.make_env(self.config)
            result["observation"] = str(observation)
            state = self.pack_state(self.env, self.config)
            result["state"] = state
            if req.get("resident"):
                result["state_sha"] = hashlib.sha256(state).hexdigest()
            self.episode(self.env, result)
        elif op == "step":
            self.config, self.env = self.unpack_state()
            self.step_env(req.get("action", ""), result)
        elif op == "reset":
            config, env = self.unpack_state()
            if req.get("config"):
                config = parse_config(req["config"])
            result["observation"] = str(env.reset(config))
            result["state"] = self.pack_state(env, config)
            self.episode(env, result)
        elif op == "ref_answer":
            import tracemalloc

            env, _ = self.make_env(parse_config(req.get("config")))
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

    def answer(self, value: Any, result: dict[str, Any]) -> None:
        result["answer_repr"] = repr(value)[:4096]
        try:
            result["answer_json"] = json.dumps(canonical(value), sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            result["answer_json"] = ""

    def solve(self, result: dict[str, Any]) -> None:
        req = self.req
        config = parse_config(req.get("config"))
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

    def run_script(self, result: dict[str, Any]) -> dict[str, Any]:
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
    the interpreter's own objects (json, pickle, base64, gymnasium's classes). Taking those copies
    while the spare child waits keeps them off the request's latency.
    """
    import gymnasium

    state = base64.b64encode(pickle.dumps(({"k": [1, "a"]}, gymnasium.Env()), protocol=5)).decode()
    frame = json.dumps({"status": "ok", "state": state, "observation": "x", "usage": {"wall_ms": 0}})
    config, env = pickle.loads(base64.b64decode(json.loads(frame)["state"]))
    CappedWriter(64).write(str(config) + str(env))
    resource.getrusage(resource.RUSAGE_SELF)


def child_main(req_fd: int, result_fd: int, codes: Mapping[str, types.CodeType]) -> None:
    """A spare child: wait for one request, serve it, report; exit, or stay as a resident session."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    with contextlib.suppress(Exception):
        warm_up()
    try:
        (length,) = HEADER.unpack(read_exact(req_fd, HEADER.size))
        req = json.loads(read_exact(req_fd, length))
    except (EOFError, ValueError):
        os._exit(0)
    limits = req["limits"]
    if req.get("resident"):
        resident.limit_cpu(limits["cpu_ms"])
    else:
        cpu_s = max(1, -(-limits["cpu_ms"] // 1000))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    memory = ZYGOTE_VM_BYTES + limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    result, child = run_request(req, codes, None)
    body = encode_result(result)
    write_all(result_fd, HEADER.pack(len(body)) + body)
    if req.get("resident") and result.get("status") == "ok" and child is not None and child.env is not None:

        def handle(frame: bytes) -> tuple[bytes, bool]:
            try:
                step_req = json.loads(frame)
                resident.limit_cpu(step_req["limits"]["cpu_ms"])
            except (ValueError, KeyError, TypeError) as exc:
                return encode_result(
                    {"status": "bad_request", "message": f"bad resident request: {exc}"}
                ), False
            out, _ = run_request(step_req, codes, child)
            return encode_result(out), out.get("status") == "ok"

        resident.serve(req_fd, result_fd, handle)
    os._exit(0)


def run_request(
    req: dict[str, Any], codes: Mapping[str, types.CodeType], child: "Child | None"
) -> tuple[dict[str, Any], "Child | None"]:
    """Serve one request in this process (a fresh `Child`, or the resident one for its next step)."""
    import random

    started = time.monotonic()
    cpu_before = resident.cpu_seconds()
    random.seed(req.get("seed", 0))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(req.get("seed", 0) % 2**32)
    try:
        if child is None:
            code = codes.get(req["sha"])
            if code is None:
                code = compile(req["source"], "<env>", "exec")
            child = Child(req, code)
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
    if isinstance(result.get("state"), bytes):
        result["state"] = base64.b64encode(result["state"]).decode()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["usage"] = {
        "wall_ms": int((time.monotonic() - started) * 1000),
        "cpu_ms": int((usage.ru_utime + usage.ru_stime - cpu_before) * 1000),
        "peak_rss_kb": usage.ru_maxrss,
        "peak_alloc_bytes": result.pop("peak_alloc_bytes", 0),
    }
    return result, child


def encode_result(result: dict[str, Any]) -> bytes:
    """A result as JSON bytes (without the length header)."""
    try:
        return _dumps(result).encode()
    except (TypeError, ValueError) as exc:
        return _dumps({"status": "env_error", "message": f"result not serializable: {exc}"}).encode()


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


ZYGOTE_VM_BYTES = 0
BUILTINS = dict(builtins.__dict__)


def mounts_under_tmp() -> frozenset[str]:
    """Mount points below /tmp (a venv or checkout under /tmp) and every folder on the way to them."""
    keep: set[str] = set()
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return frozenset()
    for point in points:
        if point.startswith("/tmp/"):
            path = point
            while path not in ("/tmp", "/"):
                keep.add(path)
                path = os.path.dirname(path)
    return frozenset(keep)


TMP_MOUNTS: frozenset[str] = frozenset()


def wipe_tmp(folder: str = "/tmp") -> None:
    """Empty the jail's tmpfs so no file outlives the request that wrote it (mounts stay)."""
    import shutil

    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.path in TMP_MOUNTS:
                if entry.is_dir(follow_symlinks=False) and not os.path.ismount(entry.path):
                    wipe_tmp(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def kill_leftovers(keep: set[int]) -> None:
    """Kill every process in the jail but this one and `keep` (resident sessions, the spare), and reap.

    The zygote is pid 1 of the jail's pid namespace, so whatever a request left behind (its own
    children included, reparented here) shows in /proc and is reaped here.
    """
    me = os.getpid()
    victims: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me or pid in keep:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            victims.add(pid)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            victims.discard(pid)
            continue
        if not victims:
            return
        time.sleep(0.0005)


def id_span() -> int:
    """How many ids the jail maps from 0 (1 when it maps one id: no room to give each process its own)."""
    try:
        with open("/proc/self/uid_map") as f:
            first, _, count = f.readline().split()
        return int(count) if first == "0" else 1
    except (OSError, ValueError):
        return 1


# Set in main(): the jail maps ids 0..ID_SPAN-1 and the zygote is 0 with the powers to hand them out.
ID_SPAN = 1
ISOLATED = False


def become(uid: int) -> None:
    """Make this freshly forked process a stranger to every other session's: its own uid and gid,
    no supplementary group (group 0 is the one /proc's hidepid exempts), no capability left (the
    kernel clears them when every uid of a process leaves 0) and, since its uids changed, not
    dumpable: no other id can signal it, see it in /proc, or read its memory or environment.
    Files it makes are its own (umask 077)."""
    if not ISOLATED:
        return
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.umask(0o077)


def last_pid() -> int:
    """The last pid the jail's pid namespace handed out (-1 when unreadable).

    Unchanged since the last cleanup means no process (or thread) was created since, so there is
    nothing to kill and the /proc scan, the costliest part of a resident step, can be skipped.
    """
    try:
        fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
        try:
            return int(os.read(fd, 32))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return -1


# A full scan at least this often anyway, so that a step that cycled through the whole pid space
# back to the same last pid cannot keep a process alive past a few requests.
FULL_SCAN_EVERY = 16


class Resident:
    """A resident session's process, as the zygote sees it."""

    __slots__ = ("last_used", "pid", "pidfd", "req_w", "res_r", "uid", "version")

    def __init__(self, pid: int, req_w: int, res_r: int, version: str, uid: int) -> None:
        self.pid = pid
        self.uid = uid
        self.req_w = req_w
        self.res_r = res_r
        self.version = version
        self.last_used = time.monotonic()
        # Kept open for the session's life: readable once the process has exited.
        self.pidfd = os.pidfd_open(pid)

    def exited(self) -> bool:
        ready, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(ready)


def child_status(
    pid: int, started: float, limits: dict[str, int], timed_out: bool, oversized: bool, *, kill: bool = False
) -> dict[str, Any]:
    """Reap a child that gave no usable result (killing it first) and say why."""
    if timed_out or oversized or kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    usage_out = {
        "wall_ms": int((time.monotonic() - started) * 1000),
        "cpu_ms": int((usage.ru_utime + usage.ru_stime) * 1000),
        "peak_rss_kb": usage.ru_maxrss,
    }
    result: dict[str, Any]
    if timed_out:
        result = {"status": "timeout", "message": f"wall-clock limit of {limits['wall_ms']} ms exceeded"}
    elif oversized:
        result = {"status": "output_limit", "message": f"result larger than {MAX_RESULT_BYTES} bytes"}
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and usage_out["cpu_ms"] >= limits["cpu_ms"]):
            result = {"status": "timeout", "message": f"CPU limit of {limits['cpu_ms']} ms exceeded"}
        elif sig == signal.SIGKILL:
            result = {"status": "killed", "message": "killed by SIGKILL (memory or process limit)"}
        else:
            result = {"status": "crashed", "message": f"killed by signal {signal.Signals(sig).name}"}
        result["exit_code"] = 128 + sig
    else:
        code = os.WEXITSTATUS(status)
        result = {"status": "crashed", "message": f"process exited with code {code} without a result"}
    result["usage"] = usage_out
    return result


def collect(
    pid: int, res_r: int, started: float, limits: dict[str, int], pidfd: int | None = None
) -> dict[str, Any]:
    """One result from a child within the request's wall limit, or the reason there is none.

    A result that came back has no "reaped" key; otherwise the child was killed (if it overran)
    and reaped, and the result says why ("timeout", "killed", ...), with "reaped": True. `pidfd`:
    the child's, when the caller keeps one open (resident sessions); else one is opened here.
    """
    deadline = started + limits["wall_ms"] / 1000.0
    buf = bytearray()
    need = None
    timed_out = oversized = False
    # Watch the child itself too: a grandchild holding the result pipe must not hide its death.
    own_pidfd = pidfd is None
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    exited = False
    try:
        while need is None or len(buf) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([res_r, pidfd], [], [], remaining)
            if res_r in ready:
                chunk = os.read(res_r, 1 << 20)
                if not chunk:
                    break
                buf += chunk
                if need is None and len(buf) >= HEADER.size:
                    (need,) = HEADER.unpack(bytes(buf[: HEADER.size]))
                    need += HEADER.size
                    if need > MAX_RESULT_BYTES:
                        oversized = True
                        break
            elif pidfd in ready:
                if exited:
                    break
                exited = True  # read once more: the result may already sit in the pipe
    finally:
        if own_pidfd:
            os.close(pidfd)
    if not (timed_out or oversized) and need is not None and len(buf) >= need:
        try:
            result = json.loads(bytes(buf[HEADER.size : need]))
            if isinstance(result, dict):
                return result
        except ValueError:
            pass
    # No usable result: whatever the child still does is of no use; make sure it is gone.
    result = child_status(pid, started, limits, timed_out, oversized, kill=True)
    result["reaped"] = True
    return result


class Zygote:
    """Serves requests one at a time: one-shot operations in a child forked *before* the request
    arrived, steps of resident sessions in that session's own child.

    Forking a process that has numpy and gymnasium loaded costs over a millisecond; doing it (and
    reaping the previous child) after answering keeps it off the request's latency. A session's
    steps after its first skip the fork altogether (resident.py).
    """

    def __init__(self) -> None:
        self.codes: collections.OrderedDict[str, types.CodeType] = collections.OrderedDict()
        self.spare: tuple[int, int, int] | None = None
        self.residents: collections.OrderedDict[str, Resident] = collections.OrderedDict()
        self.seen_last_pid = -2
        self.since_scan = 0
        self.last_uid = 0
        self.spare_uid = 0

    def allocate_uid(self) -> int:
        """An id for the next process: none a live resident session or the spare holds."""
        held = {r.uid for r in self.residents.values()}
        if self.spare is not None:
            held.add(self.spare_uid)
        for _ in range(ID_SPAN):
            self.last_uid = self.last_uid % (ID_SPAN - 1) + 1
            if self.last_uid not in held:
                return self.last_uid
        raise RuntimeError("no free id for a new process")

    def prefork(self) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        uid = self.allocate_uid() if ISOLATED else 0
        pid = os.fork()
        if pid == 0:
            become(uid)
            os.close(req_w)
            os.close(res_r)
            # Other sessions' pipes must not reach code of this one: close every inherited fd but
            # stdio and our own two.
            low, high = sorted((req_r, res_w))
            os.closerange(3, low)
            os.closerange(low + 1, high)
            os.closerange(high + 1, MAX_FDS)
            try:
                child_main(req_r, res_w, self.codes)
            finally:
                os._exit(70)
        os.close(req_r)
        os.close(res_w)
        self.spare = (pid, req_w, res_r)
        self.spare_uid = uid

    def spare_died(self) -> bool:
        """Reap the spare child if something killed it while it waited (an OOM kill, an operator):
        a request handed to it would fail for no fault of its own."""
        assert self.spare is not None
        pid, req_w, res_r = self.spare
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if not done:
            return False
        os.close(req_w)
        os.close(res_r)
        return True

    def touch(self, sha: str) -> None:
        """Mark a cached source as recently used, so LRU eviction matches the worker's bookkeeping."""
        if sha in self.codes:
            self.codes.move_to_end(sha)

    def check_source(self, req: dict[str, Any]) -> dict[str, Any] | None:
        """Compile a source new to this jail into the cache (once), or say why it cannot be served."""
        sha = req.get("sha", "")
        source = req.get("source")
        if sha in self.codes:
            return None
        if source is None:
            return {"status": "source_needed", "message": "source not cached in the jail"}
        if hashlib.sha256(source.encode()).hexdigest() != sha:
            return {
                "status": "bad_request",
                "message": "source does not match its sha256",
                "source_rejected": True,
            }
        try:
            code = compile(source, "<env>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            return {
                "status": "bad_request",
                "message": f"source does not compile: {exc}",
                "source_rejected": True,
            }
        except (MemoryError, RecursionError) as exc:
            return {
                "status": "bad_request",
                "message": f"source too complex to compile: {type(exc).__name__}",
                "source_rejected": True,
            }
        self.codes[sha] = code
        if len(self.codes) > CODE_CACHE_SIZE:
            self.codes.popitem(last=False)
        return None

    def serve(self, req: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """Run one request; return its result and the one-shot child to reap after answering."""
        op = req.get("op")
        if op == "release":
            self.evict(str(req.get("session") or ""))
            return {"status": "ok"}, None
        key = str(req.get("session") or "") if op in ("step", "create") else ""
        if key and op == "create":
            # The new session lives on in the process that built it: its first step is resident.
            self.evict(key)
            req["resident"] = True
        elif key:
            # The worker sends the state's sha256 with every session step; none never matches.
            version = str(req.get("state_sha") or "")
            held = self.residents.get(key)
            if held is not None:
                if held.version == version and not held.exited():
                    return self.serve_resident(key, held, req), None
                self.evict(key)
            req["resident"] = True
        if key and not self.admit(int(req.get("resident_cap") or RESIDENT_CAP)):
            req["resident"] = False
        problem = self.check_source(req)
        if problem is not None:
            return problem, None
        if self.spare is not None and self.spare_died():
            self.spare = None
        if self.spare is None:
            self.prefork()
        assert self.spare is not None
        pid, req_w, res_r = self.spare
        self.spare = None
        # spare_uid stays until the next prefork: the resident made from this child keeps it.
        started = time.monotonic()
        with contextlib.suppress(OSError):
            write_all(req_w, encode_frame(req))
        result = collect(pid, res_r, started, req["limits"])
        if key and not result.get("reaped") and result.get("status") == "ok" and result.get("state_sha"):
            self.residents[key] = Resident(pid, req_w, res_r, str(result.pop("state_sha")), self.spare_uid)
            result["resident"] = False
            return result, None
        result.pop("state_sha", None)
        os.close(req_w)
        os.close(res_r)
        return result, (None if result.pop("reaped", False) else pid)

    def serve_resident(self, key: str, held: Resident, req: dict[str, Any]) -> dict[str, Any]:
        """A step in the session's own process: no fork, no unpickling."""
        self.residents.move_to_end(key)
        started = time.monotonic()
        light = {k: v for k, v in req.items() if k not in ("state", "source")}
        light["resident"] = True
        with contextlib.suppress(OSError):
            write_all(held.req_w, encode_frame(light))
        result = collect(held.pid, held.res_r, started, req["limits"], held.pidfd)
        if not result.pop("reaped", False) and result.get("status") == "ok" and result.get("state_sha"):
            held.version = str(result.pop("state_sha"))
            held.last_used = time.monotonic()
            result["resident"] = True
            return result
        # Failed: the child's copy is not the committed state any more; the next step runs cold.
        result.pop("state_sha", None)
        self.evict(key)
        return result

    def admit(self, cap: int) -> bool:
        """Room for one more resident session: free, or made by evicting one idle for a while.

        When more sessions step than a jail can hold, evicting the least recently used one for
        every newcomer would make every step cold and pay a process teardown on top; instead
        the newcomer runs one-shot until a resident has sat idle for `ADMIT_IDLE_S`.
        """
        if len(self.residents) < cap:
            return True
        oldest_key, oldest = next(iter(self.residents.items()))
        if time.monotonic() - oldest.last_used < ADMIT_IDLE_S:
            return False
        self.evict(oldest_key)
        return True

    def evict(self, key: str) -> None:
        held = self.residents.pop(key, None)
        if held is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(held.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(held.pid, 0)
        for fd in (held.req_w, held.res_r, held.pidfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def cleanup(self, req: dict[str, Any], pid: int | None) -> None:
        """After answering: reap the child, kill whatever else ran, evict idle sessions, fork the next spare."""
        if pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        cap = int(req.get("resident_cap") or RESIDENT_CAP)
        idle_s = float(req.get("resident_idle_s") or RESIDENT_IDLE_S)
        now = time.monotonic()
        for key, held in list(self.residents.items()):
            if now - held.last_used > idle_s:
                self.evict(key)
        while len(self.residents) > cap:
            self.evict(next(iter(self.residents)))
        self.since_scan += 1
        if last_pid() != self.seen_last_pid or self.since_scan >= FULL_SCAN_EVERY:
            keep = {held.pid for held in self.residents.values()}
            if self.spare is not None:
                keep.add(self.spare[0])
            kill_leftovers(keep)
            self.since_scan = 0
        wipe_tmp()
        self.touch(str(req.get("sha", "")))
        if self.spare is None:
            self.prefork()
        self.seen_last_pid = last_pid()


def main() -> None:
    global ZYGOTE_VM_BYTES, TMP_MOUNTS, ID_SPAN, ISOLATED
    TMP_MOUNTS = mounts_under_tmp()
    ID_SPAN = id_span()
    ISOLATED = ID_SPAN > 1 and os.getuid() == 0
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    ZYGOTE_VM_BYTES = vm_bytes()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    zygote = Zygote()
    gc.collect()
    gc.freeze()
    zygote.prefork()
    in_fd, out_fd = 0, 1
    send_frame(
        out_fd,
        {"ready": True, "pid": os.getpid(), "python": sys.version.split()[0], "isolated": ISOLATED},
    )
    while True:
        try:
            (length,) = HEADER.unpack(read_exact(in_fd, HEADER.size))
            req = json.loads(read_exact(in_fd, length))
        except EOFError:
            return
        pid = None
        try:
            result, pid = zygote.serve(req)
        except Exception as exc:
            result = {"status": "crashed", "message": f"zygote error: {type(exc).__name__}: {exc}"}
        result["id"] = req.get("id")
        send_frame(out_fd, result)
        zygote.cleanup(req, pid)


if __name__ == "__main__":
    main()
