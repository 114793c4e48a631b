"""The episode record's bodies, declared: what a task's and an environment's tally hold, and how
each field merges.

One declaration drives everything that reads or merges a body:
- `TaskTally` and `EnvTally` name each field with its merge kind (`Merge`): a counter adds, a
  maximum keeps the highest, a window of n marks appends and keeps the last n characters, a "last
  n" list appends and keeps the last n items, and the groups of a task (below) combine by policy
  version and keep the n latest versions;
- `merge` (Python: the SQLite store and the recorder's pending deltas) and `lua_merge` (the Lua
  that Redis runs, generated from the same fields) follow those kinds, and nothing else: a delta
  naming a field the declaration lacks is refused by both;
- readers get typed tallies (`TaskTally.of(body)`), never string keys.

A delta may also carry `reset`, the fields to clear before it is merged (lifting a quarantine
clears the environment's step window). tests/test_record_merge.py runs both merges on the same
random deltas against a real redis-server.

The indexes the stores keep beside the bodies (a task's pool rate, its recent rate, whether an
environment is quarantined) are derived from a merged body by `pool_score`, `recent_score` and
`quarantined`; the Lua has the same three rules, checked by the same test.

A run's counts per policy version (`account`, and the same lines of the Lua) come from each merge
of a task's body too, never from a walk:
- its (task, policy version) groups: a task's body keeps its groups of the `GROUP_VERSIONS`
  latest versions that played it (episodes, lowest and highest reward). A merge that adds episodes
  to a group changes the group's contribution to its version's counts (groups, groups of two
  episodes or more, zero-variance groups: two or more, every reward equal), so a version's counts
  hold its open groups as well as its closed ones, and a group's episodes merged from two replicas
  count as they would from one (each merge adds what the group gained). A group older than the
  kept versions when its episodes arrive (the task was played at 4 newer versions since) counts
  as a group of its own. A replica's unflushed delta keeps 4 versions of a task too: a task played
  at more than 4 versions while the store cannot be written (held deltas, `Recorder.flush`) has
  its oldest groups left out of the counts (its other tallies keep every episode);
- its tasks that moved pools: the latest group of a task holds the task's pool when that version
  first reached the record (`start`); each merge moves the task's contribution at that version
  from (start → pool before) to (start → pool after). So a version counts each task once, by where
  it was when the version began and where it is at the version's end (or now): tasks, not steps.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, Self

from codegym_client.curriculum import DEFAULT_MIN_EPISODES, Band

# Outcomes of the last episodes of a task kept per run ('1' rewarded, '0' not): the recent pass rate.
TASK_WINDOW = 32
# Episodes of a task's recent window its pool is decided by (two GRPO groups of 8).
POOL_WINDOW = 16
# Steps of an environment kept ('.' served, 'x' failed by the environment or a time-out, 'l' a
# sandbox limit): what quarantine decides from.
ENV_WINDOW = 64
# Examples kept per environment (recent error messages, sessions of suspected shortcuts).
LIST_KEEP = 5
# Quarantine: at least this many of an environment's recent steps, this share of them failed.
QUARANTINE_MIN_STEPS = 20
QUARANTINE_RATE = 0.5
# Failed steps by kind, as `StepErrorCode` names them.
FailureKind = Literal["env_error", "step_timeout", "sandbox_limit"]
FAILURE_KINDS: tuple[FailureKind, ...] = ("env_error", "step_timeout", "sandbox_limit")
# A task's pool score while the run has played it fewer than `DEFAULT_MIN_EPISODES` times.
MEASURING = -1.0
# Policy versions of a task whose (task, version) groups its run's body keeps open: the 4 latest
# versions that played it, so an episode arriving late (a trainer's off-policy lag, a replica's
# late flush) still joins its group unless the task was played at 4 newer versions since.
GROUP_VERSIONS = 4
# Significant digits a group's rewards are kept to: Redis's Lua writes numbers with 14, so both
# stores keep the same lowest and highest reward and agree on which groups are all equal.
REWARD_DIGITS = 9


class Merge(enum.Enum):
    """How a field of a tally takes a delta."""

    COUNTER = "counter"  # adds
    MAXIMUM = "maximum"  # keeps the highest
    WINDOW = "window"  # a string of marks: appends, keeps the last `keep` characters
    LAST = "last"  # a list: appends, keeps the last `keep` items
    GROUPS = "groups"  # (task, policy version) groups: a version's combine, the `keep` latest kept


def counter() -> Any:
    return field(default=0, metadata={"merge": Merge.COUNTER, "keep": 0})


def maximum() -> Any:
    return field(default=0, metadata={"merge": Merge.MAXIMUM, "keep": 0})


def window(keep: int) -> Any:
    return field(default="", metadata={"merge": Merge.WINDOW, "keep": keep})


def last(keep: int) -> Any:
    return field(default=(), metadata={"merge": Merge.LAST, "keep": keep})


def groups(keep: int) -> Any:
    return field(default=(), metadata={"merge": Merge.GROUPS, "keep": keep})


class Group(NamedTuple):
    """A task's episodes of one policy version, for its run (stored as a JSON list in this order)."""

    version: int
    episodes: int
    low: float  # the lowest reward (to `REWARD_DIGITS` significant digits)
    high: float  # the highest
    start: str  # the task's pool when the version first reached the record ("" in a delta)


def group_of(version: int, reward: float) -> list[Any]:
    """One episode's group as a delta holds it."""
    kept = float(f"{reward:.{REWARD_DIGITS}g}")
    return [version, 1, kept, kept, ""]


class Tally:
    """What both tallies share: their declaration read back, and a body read into one."""

    SCHEMA: ClassVar[str]

    @classmethod
    def declared(cls) -> dict[str, tuple[Merge, int]]:
        """Each field's merge kind and bound, from the dataclass's fields."""
        return {f.name: (f.metadata["merge"], f.metadata["keep"]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def of(cls, body: dict[str, Any] | None) -> Self:
        """A stored body as a tally (fields it lacks at their zero; lists as tuples)."""
        if not body:
            return cls()
        values = {}
        for name, (kind, _) in DECLARED[cls.SCHEMA].items():
            if name in body:
                value = body[name]
                if kind is Merge.LAST:
                    value = tuple(str(v) for v in value)
                elif kind is Merge.GROUPS:
                    value = tuple(
                        Group(int(v), int(n), float(lo), float(hi), str(s)) for v, n, lo, hi, s in value
                    )
                values[name] = value
        return cls(**values)


@dataclass(frozen=True, slots=True)
class TaskTally(Tally):
    """A task configuration's record, per run and for every run together."""

    SCHEMA: ClassVar[str] = "task"

    episodes: int = counter()
    passes: int = counter()
    steps: int = counter()
    done: int = counter()
    truncated: int = counter()
    env_error: int = counter()
    step_timeout: int = counter()
    sandbox_limit: int = counter()
    version: int = maximum()  # the highest policy version that played it
    # Ends of forked sessions (branches), counted apart from episodes: nothing else reads them, so a
    # prefix several branches share weighs once in the pass rates, the pools and the sentinel.
    branches: int = counter()
    branch_passes: int = counter()
    recent: str = window(TASK_WINDOW)  # '1' rewarded, '0' not, oldest first
    # The run's groups of the task by policy version, oldest first (kept in a run's body only: a
    # version number means something within one run).
    groups: tuple[Group, ...] = groups(GROUP_VERSIONS)

    def recent_rate(self, last: int = 0) -> tuple[int, float]:
        """(episodes in the recent window, or in its `last` ones, and their pass rate)."""
        marks = self.recent[-last:] if last else self.recent
        return len(marks), (marks.count("1") / len(marks)) if marks else 0.0


@dataclass(frozen=True, slots=True)
class EnvTally(Tally):
    """An environment's record (every run together)."""

    SCHEMA: ClassVar[str] = "env"

    episodes: int = counter()
    passes: int = counter()
    steps: int = counter()
    env_error: int = counter()
    step_timeout: int = counter()
    sandbox_limit: int = counter()
    shortcuts: int = counter()
    lifts: int = counter()
    branches: int = counter()  # as TaskTally's
    branch_passes: int = counter()
    window: str = window(ENV_WINDOW)  # '.' served, 'x' failed, 'l' a sandbox limit
    recent_errors: tuple[str, ...] = last(LIST_KEEP)
    shortcut_sessions: tuple[str, ...] = last(LIST_KEEP)

    def quarantine_reason(self) -> str:
        """Why the environment is quarantined ("" when it is not), from its recent steps."""
        failed = self.window.count("x")
        if len(self.window) < QUARANTINE_MIN_STEPS or failed < QUARANTINE_RATE * len(self.window):
            return ""
        return (
            f"{failed} of its last {len(self.window)} steps failed (environment errors or time-outs); "
            f"{self.env_error} environment errors and {self.step_timeout} time-outs in {self.steps} steps served"
        )


Schema = Literal["task", "env"]
DECLARED: dict[str, dict[str, tuple[Merge, int]]] = {
    TaskTally.SCHEMA: TaskTally.declared(),
    EnvTally.SCHEMA: EnvTally.declared(),
}


class UnknownField(ValueError):
    """A delta names a field its tally does not declare."""


def merge(schema: str, body: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """`body` with `delta` merged in by the declaration of `schema` ("task" or "env"); `body` is
    changed. Raises `UnknownField` for a field the tally lacks."""
    declared = DECLARED[schema]
    for name in delta.get("reset", ()):
        body.pop(name, None)
    for name, value in delta.items():
        if name == "reset":
            continue
        if name not in declared:
            raise UnknownField(f"a {schema} tally has no field {name!r}")
        kind, keep = declared[name]
        if kind is Merge.COUNTER:
            body[name] = body.get(name, 0) + value
        elif kind is Merge.MAXIMUM:
            body[name] = max(body.get(name, 0), value)
        elif kind is Merge.WINDOW:
            body[name] = (body.get(name, "") + value)[-keep:]
        elif kind is Merge.GROUPS:
            if value:
                body[name] = merge_groups(body.get(name, []), value, keep)
        elif value:  # an empty list adds nothing (and Lua's JSON could not tell it from an object)
            body[name] = (list(body.get(name, [])) + list(value))[-keep:]
    return body


def merge_groups(held: list[list[Any]], added: list[list[Any]], keep: int) -> list[list[Any]]:
    """Groups by version: `added`'s join `held`'s of their version (episodes add, the lowest and
    highest reward, the start held first), the `keep` latest versions kept, oldest first."""
    if len(added) == 1 and held and held[-1][0] == added[0][0]:  # one more episode of the latest
        g, last = added[0], list(held[-1])
        last[1] += g[1]
        last[2], last[3] = min(last[2], g[2]), max(last[3], g[3])
        last[4] = last[4] or g[4]
        return [*held[:-1], last][-keep:]
    by_version = {int(g[0]): list(g) for g in held}
    for g in added:
        mine = by_version.get(int(g[0]))
        if mine is None:
            by_version[int(g[0])] = list(g)
        else:
            mine[1] += g[1]
            mine[2], mine[3] = min(mine[2], g[2]), max(mine[3], g[3])
            mine[4] = mine[4] or g[4]
    return [by_version[v] for v in sorted(by_version)][-keep:]


# A run's counts at a policy version (`account`): its (task, version) groups, those of two
# episodes or more, the zero-variance ones; and its tasks that moved pools, named "from>to".
GROUPS_COUNTED, MULTI_COUNTED, ZERO_COUNTED = "groups", "multi", "zero"


def _contribution(group: list[Any] | None) -> Counter[str]:
    if group is None:
        return Counter()
    multi = group[1] >= 2
    return Counter(
        {GROUPS_COUNTED: 1, MULTI_COUNTED: int(multi), ZERO_COUNTED: int(multi and group[2] == group[3])}
    )


def pool_name(body: dict[str, Any] | None) -> str:
    """The task's pool by its body, in the default band (unseen before an episode; learnable while
    still measured), as the history counts it."""
    score = pool_score(body or {})
    if score is None:
        return "unseen"
    return "learnable" if score == MEASURING else Band().place(score)


def account(
    old: dict[str, Any] | None, body: dict[str, Any], delta: dict[str, Any]
) -> dict[int, Counter[str]]:
    """What merging `delta` into the task body `old` (giving `body`) changes in its run's counts
    per policy version (module doc), as signed changes. Sets the start of a group the merge made
    the task's latest (`body` is changed). The Lua merge does the same."""
    counted: dict[int, Counter[str]] = {}
    current = {int(g[0]): g for g in (old or {}).get("groups", [])}
    for g in delta.get("groups", []):
        held = current.get(int(g[0]))
        joined = current[int(g[0])] = merge_groups([] if held is None else [held], [g], 1)[0]
        change = counted.setdefault(int(g[0]), Counter())
        change.update(_contribution(joined))
        change.subtract(_contribution(held))
    kept = body.get("groups") or []
    if kept:
        top, was, now = kept[-1], pool_name(old), pool_name(body)
        old_groups = (old or {}).get("groups") or []
        change = counted.setdefault(int(top[0]), Counter())
        if old_groups and old_groups[-1][0] == top[0]:
            if was != now:
                if top[4] != was:
                    change[f"{top[4]}>{was}"] -= 1
                if top[4] != now:
                    change[f"{top[4]}>{now}"] += 1
        else:
            top[4] = was
            if was != now:
                change[f"{was}>{now}"] += 1
    changes = {v: Counter({name: n for name, n in c.items() if n}) for v, c in counted.items()}
    return {v: c for v, c in changes.items() if c}


def pool_score(body: dict[str, Any]) -> float | None:
    """The task's place in its scope's pool index: the pass rate of its last `POOL_WINDOW`
    episodes, `MEASURING` before `DEFAULT_MIN_EPISODES` of them; None when it has no episode (a
    failed step alone does not make a task played)."""
    if not body.get("episodes"):
        return None
    marks = str(body.get("recent", ""))[-POOL_WINDOW:]  # read off the body: each merge asks, twice
    return marks.count("1") / len(marks) if len(marks) >= DEFAULT_MIN_EPISODES else MEASURING


def recent_score(body: dict[str, Any]) -> float | None:
    """The task's pass rate over its whole recent window (what the gauges band); None when empty."""
    marks = str(body.get("recent", ""))
    return marks.count("1") / len(marks) if marks else None


def quarantined(body: dict[str, Any]) -> bool:
    return bool(EnvTally.of(body).quarantine_reason())


def error_score(body: dict[str, Any]) -> float | None:
    """An environment's place in the errors index: the share of its served steps that failed
    (`FAILURE_KINDS`, all time, what Health ranks by); None when none failed."""
    failed = sum(int(body.get(kind) or 0) for kind in FAILURE_KINDS)
    if not failed:
        return None
    return failed / max(int(body.get("steps") or 0), failed)


# What a scope's counts are kept by (`classes`): each played task's pool in the default band (a
# task still being measured is learnable), and each task's recent rate in quarter bands (the
# `codegym_record_tasks` gauge). Counted as bodies change, never by walking a scope.
POOL_CLASSES = ("learnable", "mastered", "unsolved")
BANDS = ("0", "0.00-0.25", "0.25-0.50", "0.50-0.75", "0.75-1.00", "1")
# Each class's range of its index's score: (low, high, low excluded, high excluded).
CLASS_RANGES: dict[str, tuple[str, float, float, bool, bool]] = {
    "pool:unsolved": ("pool", 0.0, 0.0, False, False),
    "pool:mastered": ("pool", 1.0, 1.0, False, False),
    "pool:learnable": ("pool", 0.0, 1.0, True, True),
    "pool:measuring": ("pool", MEASURING, MEASURING, False, False),
    "band:0": ("recent", 0.0, 0.0, False, False),
    "band:0.00-0.25": ("recent", 0.0, 0.25, True, True),
    "band:0.25-0.50": ("recent", 0.25, 0.5, False, True),
    "band:0.50-0.75": ("recent", 0.5, 0.75, False, True),
    "band:0.75-1.00": ("recent", 0.75, 1.0, False, True),
    "band:1": ("recent", 1.0, 1.0, False, False),
}


def classes(body: dict[str, Any] | None) -> set[str]:
    """The counted classes a task body is in (`CLASS_RANGES`)."""
    if not body:
        return set()
    scores = {"pool": pool_score(body), "recent": recent_score(body)}
    out = set()
    for name, (index, low, high, low_open, high_open) in CLASS_RANGES.items():
        score = scores[index]
        if score is None:
            continue
        if (score > low if low_open else score >= low) and (score < high if high_open else score <= high):
            out.add(name)
    return out


def pool_counts(counts: dict[str, int]) -> dict[str, int]:
    """A scope's counts as its played tasks' pools in the default band."""
    return {
        "learnable": counts.get("pool:learnable", 0) + counts.get("pool:measuring", 0),
        "mastered": counts.get("pool:mastered", 0),
        "unsolved": counts.get("pool:unsolved", 0),
    }


def _lua_table() -> str:
    """The declaration as a Lua table literal: schema → field → {kind, keep}."""
    schemas = []
    for schema, declared in DECLARED.items():
        fields = ", ".join(f"{name} = {{'{kind.value}', {keep}}}" for name, (kind, keep) in declared.items())
        schemas.append(f"{schema} = {{{fields}}}")
    return "{" + ", ".join(schemas) + "}"


# KEYS: per delta its scope's hash, pool index and recent index (sorted sets; for the environments'
# scope, its errors index and an unused key) and its run's counts per policy version (a hash:
# version -> JSON counts; unused for the environments), then the set of quarantined environments
# last. ARGV: per delta (schema, field, delta JSON). The merge follows the declaration
# (`DECLARED`, generated into the script); the indexes follow `pool_score`, `recent_score`,
# `error_score` and `quarantined`; the counts follow `account`. Returns the number of deltas
# merged, or raises for a field the tally does not declare (nothing of the call is written: the
# check runs first).
LUA_MERGE = f"""
local declared = {_lua_table()}
local n = (#KEYS - 1) / 4
for i = 1, n do
  local decl = declared[ARGV[3 * i - 2]]
  for name, _ in pairs(cjson.decode(ARGV[3 * i])) do
    if name ~= 'reset' and decl[name] == nil then
      return redis.error_reply('a ' .. ARGV[3 * i - 2] .. " tally has no field '" .. name .. "'")
    end
  end
end
local function pool_of(body)
  if (body['episodes'] or 0) <= 0 then return 'unseen' end
  local recent = body['recent'] or ''
  local pool = string.sub(recent, math.max(1, #recent - {POOL_WINDOW} + 1))
  if #pool < {DEFAULT_MIN_EPISODES} then return 'learnable' end
  local _, passes = string.gsub(pool, '1', '')
  if passes == 0 then return 'unsolved' end
  if passes == #pool then return 'mastered' end
  return 'learnable'
end
local function add(counted, version, name, change)
  local names = counted[version]
  if names == nil then names = {{}}; counted[version] = names end
  names[name] = (names[name] or 0) + change
end
local function contribute(counted, group, sign)
  add(counted, group[1], '{GROUPS_COUNTED}', sign)
  if group[2] >= 2 then
    add(counted, group[1], '{MULTI_COUNTED}', sign)
    if group[3] == group[4] then add(counted, group[1], '{ZERO_COUNTED}', sign) end
  end
end
local quarantine = KEYS[#KEYS]
local pending = {{}}  -- the counts' changes of the whole call, by hash and version: written once
for i = 1, n do
  local schema, field = ARGV[3 * i - 2], ARGV[3 * i - 1]
  local decl = declared[schema]
  local delta = cjson.decode(ARGV[3 * i])
  local hash = KEYS[4 * i - 3]
  local raw = redis.call('HGET', hash, field)
  local body = {{}}
  if raw then body = cjson.decode(raw) end
  local counted = {{}}
  local was, old_top = pool_of(body), nil
  if body['groups'] and #body['groups'] > 0 then old_top = body['groups'][#body['groups']][1] end
  if delta['reset'] then
    for _, name in ipairs(delta['reset']) do body[name] = nil end
  end
  for name, value in pairs(delta) do
    if name ~= 'reset' then
      local kind, keep = decl[name][1], decl[name][2]
      if kind == 'counter' then
        body[name] = (body[name] or 0) + value
      elseif kind == 'maximum' then
        body[name] = math.max(body[name] or 0, value)
      elseif kind == 'window' then
        local joined = (body[name] or '') .. value
        body[name] = string.sub(joined, math.max(1, #joined - keep + 1))
      elseif kind == 'groups' then
        if #value > 0 then
          local items = body[name] or {{}}
          for _, g in ipairs(value) do
            local held = nil
            for _, h in ipairs(items) do
              if h[1] == g[1] then held = h end
            end
            if held then
              contribute(counted, held, -1)
              held[2] = held[2] + g[2]
              held[3] = math.min(held[3], g[3])
              held[4] = math.max(held[4], g[4])
              if held[5] == '' then held[5] = g[5] end
            else
              held = {{g[1], g[2], g[3], g[4], g[5]}}
              table.insert(items, held)
            end
            contribute(counted, held, 1)
          end
          table.sort(items, function(a, b) return a[1] < b[1] end)
          while #items > keep do table.remove(items, 1) end
          body[name] = items
        end
      elseif #value > 0 then
        local items = body[name] or {{}}
        for _, item in ipairs(value) do table.insert(items, item) end
        while #items > keep do table.remove(items, 1) end
        body[name] = items
      end
    end
  end
  local kept = body['groups']
  if schema == 'task' and kept and #kept > 0 then
    local top, now = kept[#kept], pool_of(body)
    if old_top == top[1] then
      if was ~= now then
        if top[5] ~= was then add(counted, top[1], top[5] .. '>' .. was, -1) end
        if top[5] ~= now then add(counted, top[1], top[5] .. '>' .. now, 1) end
      end
    else
      top[5] = was
      if was ~= now then add(counted, top[1], was .. '>' .. now, 1) end
    end
  end
  redis.call('HSET', hash, field, cjson.encode(body))
  if schema == 'task' then
    local recent = body['recent'] or ''
    local pool = string.sub(recent, math.max(1, #recent - {POOL_WINDOW} + 1))
    local _, pool_passes = string.gsub(pool, '1', '')
    local _, passes = string.gsub(recent, '1', '')
    if (body['episodes'] or 0) > 0 then
      local score = {MEASURING}
      if #pool >= {DEFAULT_MIN_EPISODES} then score = pool_passes / #pool end
      redis.call('ZADD', KEYS[4 * i - 2], score, field)
    else
      redis.call('ZREM', KEYS[4 * i - 2], field)
    end
    if #recent > 0 then
      redis.call('ZADD', KEYS[4 * i - 1], passes / #recent, field)
    else
      redis.call('ZREM', KEYS[4 * i - 1], field)
    end
    if next(counted) ~= nil then
      local run = pending[KEYS[4 * i]]
      if run == nil then run = {{}}; pending[KEYS[4 * i]] = run end
      for version, names in pairs(counted) do
        for name, change in pairs(names) do add(run, version, name, change) end
      end
    end
  else
    local failed = {" + ".join(f"(body['{kind}'] or 0)" for kind in FAILURE_KINDS)}
    if failed > 0 then
      redis.call('ZADD', KEYS[4 * i - 2], failed / math.max(body['steps'] or 0, failed), field)
    else
      redis.call('ZREM', KEYS[4 * i - 2], field)
    end
    local marks = body['window'] or ''
    local _, failed = string.gsub(marks, 'x', '')
    if #marks >= {QUARANTINE_MIN_STEPS} and failed >= {QUARANTINE_RATE} * #marks then
      redis.call('SADD', quarantine, field)
    else
      redis.call('SREM', quarantine, field)
    end
  end
end
for hash, versions in pairs(pending) do
  for version, names in pairs(versions) do
    local key = string.format('%d', version)
    local held = redis.call('HGET', hash, key)
    local counts = {{}}
    if held then counts = cjson.decode(held) end
    for name, change in pairs(names) do
      local total = (counts[name] or 0) + change
      if total == 0 then counts[name] = nil else counts[name] = total end
    end
    if next(counts) == nil then
      redis.call('HDEL', hash, key)
    else
      redis.call('HSET', hash, key, cjson.encode(counts))
    end
  end
end
return n
"""


# Policy versions kept in a run's history; past this the oldest go.
HISTORY_KEEP = 1_000


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    """A run's policy version: its played tasks by pool (the default band; a task still measured
    is learnable) as they stood after its last flush whose latest version this was (a version
    that only ever came with newer ones in a flush: after the first flush that held it), at `at`
    (Unix seconds); and its counts (`account`): its (task, version) groups, open and closed, and
    its tasks that moved pools ("from>to" -> tasks)."""

    version: int
    at: float
    played: int
    learnable: int
    mastered: int
    unsolved: int
    groups: int = 0
    multi_episode_groups: int = 0  # of two episodes or more
    zero_variance_groups: int = 0  # of those, every reward equal
    moves: dict[str, int] = field(default_factory=dict)

    def pools(self) -> dict[str, Any]:
        """The point's pool fields only (what a store writes per flush)."""
        return {name: getattr(self, name) for name in POOL_FIELDS}

    def counted(self, counts: dict[str, int]) -> HistoryPoint:
        """The point with its version's counts (as `account` names them; zero ones absent)."""
        return dataclasses.replace(
            self,
            groups=counts.get(GROUPS_COUNTED, 0),
            multi_episode_groups=counts.get(MULTI_COUNTED, 0),
            zero_variance_groups=counts.get(ZERO_COUNTED, 0),
            moves={name: n for name, n in sorted(counts.items()) if ">" in name},
        )


POOL_FIELDS = ("version", "at", "played", "learnable", "mastered", "unsolved")


def encode(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
