"""The messages of the worker <-> jail pipe, declared once: every key either side writes.

Both sides import this module: the worker (`sandbox_worker/service.py`, `pool.py`, `jail.py`)
builds `Request`s and reads the `Hello` and `Result`s; the jail (`zygote`, `residents`,
`operations`, `watchdog`) reads requests and writes results. On the pipe each is a frame
(`frames`): a JSON head with every key but the binary parts (`PARTS`: a session's `state`, a
spare's `code`), which follow the head raw. They are TypedDicts: plain dicts at run time, so the
jail pays nothing for the types, while mypy checks every key and value on both sides.

One request and one result travel three legs:
- worker -> zygote: a `Request` (its `id` and `cap` set by the worker's pool); the zygote answers a
  `Result`, with the keys only it sets (`ZYGOTE_KEYS`) added.
- zygote -> child: the same `Request`, plus what only the zygote tells a child (`keep_process`,
  `code`). A resident step goes as the worker wrote its head, without its parts: the resident holds
  the state (`frames.head_only`; the zygote neither decodes nor encodes it).
- child -> zygote: a `Result`; the zygote drops every key of `ZYGOTE_KEYS` a child wrote (its code
  is untrusted: it may write any frame it likes) and relays the state part as it came.

A resident session (a process that keeps one session's live environment between steps, see
`residents`) is named by three keys, one meaning each:
- `keep_process` (request, zygote -> child): stay alive as the session's process if this request
  succeeds. The version of the state it then holds is the sha256 of the state part it answered,
  which the zygote computes of the bytes it relays (never a child's claim).
- `from_resident` (result): the answer came from the session's resident process (no fork, no
  unpickling). It is the `resident` flag of the RPC's `OperationResult`.
- `made_resident` (result): the process that answered stays on as the session's resident; the
  answer itself ran cold (a create, or a step whose session the jail did not hold).

The worker never trusts a value's type (a jail runs untrusted code): it checks each before use.
These types say what an honest jail sends.
"""

from typing import Any, Literal, Required, TypedDict

# A binary part of a message: `bytes`, or a view of the frame it arrived in (no copy).
Blob = bytes | memoryview
# The binary parts of a frame, in their order on the pipe (`frames`): never keys of its JSON head.
PARTS: tuple[str, ...] = ("state", "code")
# The parts each direction may carry: a result never carries code.
REQUEST_PARTS: tuple[str, ...] = ("state", "code")
RESULT_PARTS: tuple[str, ...] = ("state",)

Op = Literal["create", "step", "reset", "ref_answer", "solve", "run_script", "call_function", "release"]
Status = Literal[
    "ok",
    "env_error",
    "timeout",
    "memory_limit",
    "output_limit",
    "killed",
    "crashed",
    "bad_request",
    "source_needed",
]
# Why a session's step ran cold: the jail never held it (or no longer did), held an older version
# of its state, or had no room for it.
Cold = Literal["absent", "stale", "full"]
# Why a resident session's process ended: released by the caller, its episode over, room made for
# a newcomer, idle too long, a step failed in it, or a newer state came in (or a create replaced it).
EvictionReason = Literal["release", "done", "room", "idle", "failed", "stale"]
CodeCacheEvent = Literal["hit", "miss", "eviction"]


class Limits(TypedDict):
    """One request's limits (the RPC's `Limits`, defaults and maximum applied by the worker)."""

    wall_ms: int
    cpu_ms: int
    memory_mb: int
    output_bytes: int


class Request(TypedDict, total=False):
    """One operation, as the worker sends it to the zygote and the zygote to a child."""

    # Set by the worker's pool: the answer must carry it back (an answer out of order kills the jail).
    id: int
    # Residents this jail may hold now: its share of the worker's budget at the measured cost of
    # one. It moves with each measurement, never above the jail's own ceiling
    # (`settings.JailSettings.resident_cap`, fixed at its start), which the zygote enforces.
    cap: int
    # Set by the worker's pool too: how long a resident may sit idle before it goes, in ms. Derived
    # from a resident's measured cost, so it moves with it (`sandbox_worker/residency.py`, `hold_s`).
    resident_idle_ms: int
    op: Required[Op]
    # The source's sha256 ("" for a release, which needs no source).
    sha: Required[str]
    limits: Required[Limits]
    # The source's text: omitted when the jail has compiled it already (the worker mirrors its cache).
    source: str
    seed: int
    # A task config (JSON or a Python dict literal, see `values.parse_config`).
    config: str
    # The session a create or step belongs to (what a resident process is kept for).
    session: str
    # A session's state (a part): opaque to the worker, which never unpickles it.
    state: Blob
    # The sha256 of the `state` a step carries: the version a resident process must hold to take
    # the step (the worker hashes what the runtime committed; the zygote only compares).
    state_sha: str
    action: str
    solve_source: str
    max_steps: int
    # Whether a solve reports its trajectory.
    record: bool
    stdin: str
    # A call_function's function and arguments.
    function: str
    args: list[Any]
    kwargs: dict[str, Any]
    # Zygote -> child only (a part): the source compiled after the child was forked, marshalled.
    code: Blob
    # Zygote -> child only: see the module's docstring.
    keep_process: bool


class Usage(TypedDict, total=False):
    wall_ms: int
    cpu_ms: int
    peak_rss_kb: int
    # A ref_answer's peak of traced allocations (0 for every other operation).
    peak_alloc_bytes: int


class CodeCacheReport(TypedDict, total=False):
    """The jail's compiled-code cache after a request, with its events since the last report."""

    entries: int
    bytes: int
    hit: int
    miss: int
    eviction: int


class Result(TypedDict, total=False):
    """One operation's answer: from a child to the zygote, then from the zygote to the worker."""

    status: Status
    message: str
    stdout: str
    stderr: str
    output_truncated: bool
    usage: Usage
    # The session's state after a create, step or reset (a part).
    state: Blob
    observation: str
    reward: float
    done: bool
    step_count: int
    answer_json: str
    answer_repr: str
    exit_code: int
    env_class: str
    trajectory: list[str]
    # Child -> zygote only: a ref_answer's allocation peak, moved into `usage` before it is sent.
    peak_alloc_bytes: int
    # From here on, keys only the zygote or the worker set (`ZYGOTE_KEYS`).
    # The request's `id` (None for a request that had none).
    id: int | None
    # Watchdog -> zygote only: the child gave no usable result and was reaped (the result says why).
    reaped: bool
    # The worker's: the jail died under the request (the pool retries it once, cold).
    jail_died: bool
    # Resident sessions the jail holds after this request.
    residents: int
    # Whether the jail still holds the request's session after it (a create or step with a session).
    held: bool
    # See the module's docstring.
    from_resident: bool
    made_resident: bool
    # Why a session's step ran cold (none when it came from a resident).
    cold: Cold
    # Resident processes ended since the last answer, by reason.
    evictions: dict[EvictionReason, int]
    code_cache: CodeCacheReport
    # Sources the jail dropped from its cache since the last answer (the worker sends them again).
    forgotten: list[str]
    # The source itself cannot be served (does not match its sha256, does not compile): the worker
    # does not count it as compiled in the jail.
    source_rejected: bool


class Hello(TypedDict):
    """The zygote's first frame, before any request: it is up, and whether it can isolate."""

    ready: bool
    pid: int
    python: str
    # Whether the zygote can give each process its own uid (the worker refuses a jail that cannot).
    isolated: bool


# Keys of a `Result` only the zygote and the worker may set: a child that wrote them into its own
# result would steer its own handling (be taken for a resident, pin its session, hide a death).
ZYGOTE_KEYS: tuple[str, ...] = (
    "id",
    "reaped",
    "jail_died",
    "residents",
    "held",
    "from_resident",
    "made_resident",
    "cold",
    "evictions",
    "code_cache",
    "forgotten",
    "source_rejected",
)


def without(req: Request, *keys: str) -> Request:
    """A copy of a request without `keys` (what the other side has already), in the same order."""
    sent = req.copy()
    for key in keys:
        sent.pop(key, None)  # type: ignore[misc]
    return sent


def from_child(result: Result) -> Result:
    """A child's result with every key only the zygote or the worker may set dropped."""
    for key in ZYGOTE_KEYS:
        result.pop(key, None)  # type: ignore[misc]
    return result
