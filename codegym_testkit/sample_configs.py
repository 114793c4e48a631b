"""Seeded, valid configs for the 12 sample environments in codegym/samples/envs/.

The scripted LLM test server answers the "write unit tests" stage for the sample problems with
configs from here, so every config must be a fair test case: valid input for the env (each
generator respects its env's invariants), a short reference answer (repr of at most 100
characters), the env's own solve() reaching reward 1 in 10..256 steps, and the original solution
in codegym/samples/problems.jsonl agreeing with the env's get_ref_answer().

Each env has a generator (one candidate config from a random.Random) and a step model that
predicts how many step() calls the env's solve() makes on that config; candidates whose predicted
step count falls outside the wanted range are drawn again. Normal configs aim at 10..150 steps,
hard ones at 40..200 (SearchInsert excepted: binary search needs thousands of elements for 40
steps, so its hard configs are larger arrays in 20..200 steps).

Nothing here imports the envs: env code only ever runs in a child interpreter.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from typing import Any

Config = dict[str, Any]
Generator = Callable[[random.Random, bool], Config | None]
StepModel = Callable[[Config], int]

NORMAL_STEPS = (10, 150)
HARD_STEPS = (40, 200)

_ALNUM = string.ascii_letters + string.digits
_PUNCT = " ,.!?'-:;"


def _max_subarray(rng: random.Random, hard: bool) -> Config:
    n = rng.randint(15, 60) if hard else rng.randint(4, 25)
    bound = 100 if hard else 20
    if rng.random() < 0.15:  # all negative: the answer is the largest element
        return {"nums": [rng.randint(-bound, -1) for _ in range(n)]}
    return {"nums": [rng.randint(-bound, bound) for _ in range(n)]}


def _palindrome(rng: random.Random, hard: bool) -> Config:
    half = [rng.choice(_ALNUM) for _ in range(rng.randint(7, 22) if hard else rng.randint(1, 9))]
    core = half + [rng.choice(_ALNUM)] * rng.randint(0, 1) + half[::-1]
    core = [c.swapcase() if rng.random() < 0.3 else c for c in core]
    if rng.random() < 0.5:  # near miss: one alphanumeric character changed
        i = rng.randrange(len(core))
        core[i] = rng.choice([c for c in _ALNUM if c.lower() != core[i].lower()])
    text = "".join(c + (rng.choice(_PUNCT) if rng.random() < 0.25 else "") for c in core)
    return {"s": text}


def _min_cost_stairs(rng: random.Random, hard: bool) -> Config:
    n = rng.randint(9, 40) if hard else rng.randint(3, 20)
    return {"cost": [rng.randint(0, 99) for _ in range(n)]}


def _count_islands(rng: random.Random, hard: bool) -> Config:
    rows, cols = (rng.randint(4, 7), rng.randint(4, 8)) if hard else (rng.randint(2, 5), rng.randint(2, 6))
    land = rng.choice([0.3, 0.4, 0.5, 0.6])
    grid = ["".join("1" if rng.random() < land else "0" for _ in range(cols)) for _ in range(rows)]
    return {"grid": grid}


def _merge_intervals(rng: random.Random, hard: bool) -> Config:
    # Groups of chained (hence overlapping or touching) intervals over disjoint spans, so the merged
    # answer has one [lo, hi] per group and stays short however many intervals there are.
    groups = rng.randint(2, 6) if hard else rng.randint(1, 4)
    total = rng.randint(max(groups, 20), 80) if hard else rng.randint(max(groups, 5), 14)
    sizes = [1] * groups
    for _ in range(total - groups):
        sizes[rng.randrange(groups)] += 1
    intervals: list[list[int]] = []
    hi = rng.randint(-5, 5)
    for size in sizes:
        lo = hi + rng.randint(1, 10)  # a gap, so no two groups merge
        hi = lo + rng.randint(3, 25 if hard else 10)
        pieces = rng.randint(1, size)
        cuts = [lo, *sorted(rng.randint(lo, hi) for _ in range(pieces - 1)), hi]
        intervals += [[cuts[i], cuts[i + 1]] for i in range(pieces)]
        for _ in range(size - pieces):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            intervals.append([min(a, b), max(a, b)])
    rng.shuffle(intervals)
    return {"intervals": intervals}


def _array_gcd(rng: random.Random, hard: bool) -> Config:
    factor = rng.choice([1, 1, 2, 3, 4, 5, 6, 7, 12, 15, 21])
    n = rng.randint(4, 10) if hard else rng.randint(2, 6)
    top = 2000 if hard else 60
    return {"nums": [factor * rng.randint(1, top) for _ in range(n)]}


def _jump_game(rng: random.Random, hard: bool) -> Config:
    n = rng.randint(14, 60) if hard else rng.randint(4, 30)
    # Reachable: keep reach >= i at every index. Unreachable: the first unreachable index is `stop`,
    # so the prefix jumps never pass stop - 1.
    stop = rng.randint(13 if hard else 3, n - 1) if n > (13 if hard else 3) and rng.random() < 0.5 else n
    nums: list[int] = []
    reach = 0
    for i in range(n):
        if i >= stop:
            value = rng.randint(0, 4)
        else:
            cap = 3 if stop == n else min(3, stop - 1 - i)
            value = rng.randint(1 if reach == i and i < n - 1 and cap > 0 else 0, cap)
        nums.append(value)
        reach = max(reach, i + value)
    return {"nums": nums}


def _ticket_queue(rng: random.Random, hard: bool) -> Config:
    n = rng.randint(4, 12) if hard else rng.randint(2, 7)
    tickets = [rng.randint(1, 20 if hard else 8) for _ in range(n)]
    return {"tickets": tickets, "k": rng.randrange(n)}


def _two_sum(rng: random.Random, hard: bool) -> Config | None:
    # Exactly one pair (i, j) sums to target; j fixes the step count (the env stops there).
    j = rng.randint(9, 45) if hard else rng.randint(2, 14)
    n = j + 1 + rng.randint(0, 8 if hard else 4)
    nums = rng.sample(range(-500, 1000) if hard else range(-50, 100), n)
    i = rng.randrange(j)
    if rng.random() < 0.15:  # the pair may be two equal values, as in [3, 3] / 6
        nums[j] = nums[i]
    target = nums[i] + nums[j]
    pairs = sum(nums[p] + nums[q] == target for p in range(n) for q in range(p + 1, n))
    return {"nums": nums, "target": target} if pairs == 1 else None


def _common_prefix(rng: random.Random, hard: bool) -> Config:
    n = rng.randint(13, 45) if hard else rng.randint(3, 12)
    letters = "abcde" if rng.random() < 0.5 else string.ascii_lowercase
    prefix = "".join(rng.choice(letters) for _ in range(rng.randint(0, 12 if hard else 6)))
    words = [prefix + "".join(rng.choice(letters) for _ in range(rng.randint(0, 6))) for _ in range(n)]
    if words[0] and rng.random() < 0.25:  # the prefix only vanishes at the last word
        words[-1] = rng.choice([c for c in letters if c != words[0][0]]) + words[-1]
    return {"words": words}


def _coin_change(rng: random.Random, hard: bool) -> Config:
    coins = rng.sample(range(1, 26 if hard else 13), rng.randint(2, 4) if hard else rng.randint(1, 3))
    return {"coins": coins, "amount": rng.randint(8, 45) if hard else rng.randint(3, 24)}


def _search_insert(rng: random.Random, hard: bool) -> Config:
    n = rng.randint(100, 600) if hard else rng.randint(4, 40)
    start = rng.randint(-200, 100)
    nums = sorted(rng.sample(range(start, start + n * rng.randint(2, 5)), n))
    pick = rng.random()
    if pick < 0.4:
        target = rng.choice(nums)
    elif pick < 0.5:
        target = nums[0] - rng.randint(1, 10)
    elif pick < 0.6:
        target = nums[-1] + rng.randint(1, 10)
    else:
        target = rng.randint(nums[0], nums[-1])
    return {"nums": nums, "target": target}


# Step models: how many step() calls each env's solve() makes, Done included.


def _euclid_rounds(a: int, b: int) -> tuple[int, int]:
    rounds = 0
    while b:
        a, b = b, a % b
        rounds += 1
    return a, rounds


def _gcd_steps(config: Config) -> int:
    nums = config["nums"]
    steps, g = 3, nums[0]
    for value in nums[1:]:
        g, rounds = _euclid_rounds(g, value)
        steps += 2 + 2 * rounds  # GetElement, IsZero per round and once more, Remainder per round
    return steps


def _islands_steps(config: Config) -> int:
    grid = config["grid"]
    rows, cols = len(grid), len(grid[0])
    steps = 2 + rows * cols  # Observe, Done, GetCell per cell in the scan
    for r in range(rows):
        for c in range(cols):
            if grid[r][c] == "1":
                near = [(r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)]
                near = [(a, b) for a, b in near if 0 <= a < rows and 0 <= b < cols]
                steps += 3 + len(near) + sum(grid[a][b] == "1" for a, b in near)
    return steps


def _merge_steps(config: Config) -> int:
    ordered = sorted(config["intervals"])
    merges, end = 0, ordered[0][1]
    for start, stop in ordered[1:]:
        merges += start <= end
        end = max(end, stop) if start <= end else stop
    return 2 + len(ordered) + merges


def _jump_steps(config: Config) -> int:
    reach = 0
    for i, jump in enumerate(config["nums"]):
        if i > reach:
            return 3 * i + 3
        reach = max(reach, i + jump)
    return 3 * len(config["nums"]) + 2


def _ticket_steps(config: Config) -> int:
    tickets, k = config["tickets"], config["k"]
    return 3 + sum(min(t, tickets[k] - (i > k)) for i, t in enumerate(tickets))


def _two_sum_steps(config: Config) -> int:
    seen: set[int] = set()
    for j, value in enumerate(config["nums"]):
        if config["target"] - value in seen:
            return 4 * j + 5
        seen.add(value)
    return 4 * len(config["nums"]) + 2


def _prefix_steps(config: Config) -> int:
    words = config["words"]
    steps, prefix = 3, words[0]
    for word in words[1:]:
        steps += 1
        if not prefix:
            break
        steps += 2
        while not word.startswith(prefix):
            prefix = prefix[:-1]
    return steps


def _coin_steps(config: Config) -> int:
    coins, amount = config["coins"], config["amount"]
    best: list[int | None] = [0] + [None] * amount
    steps = 3  # Observe, the final GetBest, Done
    for a in range(1, amount + 1):
        usable = [best[a - c] for c in coins if c <= a]
        reachable = [b + 1 for b in usable if b is not None]
        best[a] = min(reachable) if reachable else None
        steps += 1 + len(usable) + len(reachable)  # SetBest, GetBest per coin, MinCandidate per hit
    return steps


def _search_steps(config: Config) -> int:
    nums, target = config["nums"], config["target"]
    lo, hi, rounds = 0, len(nums), 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if nums[mid] < target else (lo, mid)
        rounds += 1
    return 2 + 3 * rounds


_SPECS: dict[str, tuple[Generator, StepModel]] = {
    "MaxSubarraySumEnv": (_max_subarray, lambda c: 3 * len(c["nums"])),
    "PalindromeCheckEnv": (_palindrome, lambda c: 2 + 2 * len(c["s"]) + sum(ch.isalnum() for ch in c["s"])),
    "MinCostStairsEnv": (_min_cost_stairs, lambda c: 5 * len(c["cost"]) - 3),
    "CountIslandsEnv": (_count_islands, _islands_steps),
    "MergeIntervalsEnv": (_merge_intervals, _merge_steps),
    "ArrayGcdEnv": (_array_gcd, _gcd_steps),
    "JumpGameEnv": (_jump_game, _jump_steps),
    "TicketQueueEnv": (_ticket_queue, _ticket_steps),
    "TwoSumEnv": (_two_sum, _two_sum_steps),
    "CommonPrefixEnv": (_common_prefix, _prefix_steps),
    "CoinChangeEnv": (_coin_change, _coin_steps),
    "SearchInsertEnv": (_search_insert, _search_steps),
}

SAMPLE_CLASSES: tuple[str, ...] = tuple(_SPECS)


def sample_configs(env_class: str, count: int, seed: int, *, hard: bool = False) -> list[Config]:
    """`count` distinct configs for `env_class`, the same ones for the same arguments.

    Raises KeyError for a class that is not one of SAMPLE_CLASSES.
    """
    if env_class not in _SPECS:
        raise KeyError(f"no sample config generator for {env_class!r}; known: {', '.join(SAMPLE_CLASSES)}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    generate, steps_of = _SPECS[env_class]
    low, high = HARD_STEPS if hard else NORMAL_STEPS
    if hard and env_class == "SearchInsertEnv":
        low = 20
    rng = random.Random(f"{env_class}/{seed}/{'hard' if hard else 'normal'}")
    configs: list[Config] = []
    seen: set[str] = set()
    for _ in range(1000 + 200 * count):
        if len(configs) == count:
            return configs
        config = generate(rng, hard)
        if config is None or not low <= steps_of(config) <= high:
            continue
        key = json.dumps(config, sort_keys=True)
        if key not in seen:
            seen.add(key)
            configs.append(config)
    if len(configs) < count:
        raise ValueError(f"could only draw {len(configs)} of {count} distinct {env_class} configs")
    return configs
