"""The runtime serves a library of CodeGym's published size without holding it.

A library of a few thousand environments (the samples, each copied with a unique trailing comment,
so new content under a new id, as `bench/library_scale.py` makes them) is read on demand: the
runtime's memory for records is its cache's budget whatever the library's size, listing pages
through it, and a task recorded with code of its own is served with that code, for every step.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sqlite3
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from codegym.library.store import Library
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sbg
from codegym_client import RuntimeClient
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.catalog import Catalog, tool_specs
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.servers import CodegymServer, start_runtime, start_workers
from tests.test_metrics import metrics_address, scrape

GCD = "Sample_0006_I__ArrayGcdEnv"
OBSERVE = '{"name": "Observe", "parameters": {}}'


def copy_envs(path: Path, copies: int) -> list[str]:
    """Add `copies` environments to the library at `path`, each a sample's source plus a unique
    comment line under the id `{code_id}v{n}__{Env}` (its tools are the sample's: a comment changes
    none). Written with SQL from the imported samples, so thousands take a second."""
    db = sqlite3.connect(path)
    rows = db.execute(
        "SELECT env_id, code_id, env_class, source, tools_json, tools_text, task_text FROM envs ORDER BY env_id"
    ).fetchall()
    added = []
    with db:
        for n in range(copies):
            _, code_id, env_class, source, tools_json, tools_text, task_text = rows[n % len(rows)]
            source = f"{source}\n# copy {n}\n"
            new_id = f"{code_id}v{n:05d}__{env_class}"
            db.execute(
                "INSERT INTO envs (env_id, code_id, env_class, source, sha256, tools_json, tools_text,"
                " task_text, metadata, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, '{}', 0)",
                (
                    new_id,
                    f"{code_id}v{n:05d}",
                    env_class,
                    source,
                    hashlib.sha256(source.encode()).hexdigest(),
                    tools_json,
                    tools_text,
                    task_text,
                ),
            )
            added.append(new_id)
    db.close()
    return added


def sample_library(path: Path) -> Path:
    with Library(path) as library:
        report = library.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
    assert report.skipped == []
    return path


@pytest.fixture(scope="module")
def big_library(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    path = sample_library(tmp_path_factory.mktemp("big") / "library.db")
    return path, copy_envs(path, 3000)


def test_the_catalog_holds_a_working_set_bounded_in_bytes_not_the_library(
    big_library: tuple[Path, list[str]],
) -> None:
    path, copies = big_library
    budget = 256 * 1024
    catalog = Catalog(path, cache_bytes=budget)
    try:
        assert len(catalog) == 3000 + 12
        for env_id in copies:
            record = catalog.env(env_id)
            assert record.env_id == env_id
            assert record.source.endswith(f"# copy {int(env_id.split('__')[0][-5:])}\n")
            assert catalog.records.bytes <= budget
        # What fits stays: the last ones read are hits now, the first ones long gone.
        assert copies[-1] in catalog.records and copies[0] not in catalog.records
        assert 0 < len(catalog.records) < 3000
    finally:
        catalog.close()


def test_the_working_set_costs_the_garbage_collector_two_objects_an_environment(
    big_library: tuple[Path, list[str]],
) -> None:
    """A full collection walks every container the runtime holds, and stops every step in flight
    while it does: thousands of cached environments must not add tens of thousands of them (a
    library record with its parsed tool schemas is about 35)."""
    path, copies = big_library
    catalog = Catalog(path, cache_bytes=256 * 1024 * 1024)
    try:
        gc.collect()
        before = len(gc.get_objects())
        for env_id in copies[:2000]:
            catalog.env(env_id)
        gc.collect()  # tuples of strings leave the collector's lists at their first collection
        tracked = len(gc.get_objects()) - before
        assert len(catalog.records) == 2000
        assert tracked <= 3 * 2000, tracked
        # What a create answers is what the library holds.
        stored = catalog.library.get(copies[0], tasks=False)
        assert stored is not None
        assert catalog.env(copies[0]).specs() == tool_specs(stored)
        assert catalog.env(copies[0]).tool_names == tuple(stored.tool_names)
    finally:
        catalog.close()


def test_opening_the_catalog_costs_the_same_for_12_environments_and_for_3012(
    tmp_path: Path, big_library: tuple[Path, list[str]]
) -> None:
    small = sample_library(tmp_path / "small.db")

    def opening_peak(path: Path) -> int:
        tracemalloc.start()
        try:
            catalog = Catalog(path)
            catalog.env(GCD)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        catalog.close()
        return peak

    small_peak, big_peak = opening_peak(small), opening_peak(big_library[0])
    assert big_peak < 2 * small_peak, (small_peak, big_peak)


def test_listing_pages_through_every_environment_once_in_order(big_library: tuple[Path, list[str]]) -> None:
    path, copies = big_library
    catalog = Catalog(path, cache_bytes=64 * 1024)
    try:
        seen: list[str] = []
        token = ""
        while True:
            page = catalog.list_envs(rt.ListEnvsRequest(page_size=500, page_token=token))
            seen += [e.env_id for e in page.envs]
            assert all(e.tool_names for e in page.envs)
            token = page.next_page_token
            if not token:
                break
        assert seen == sorted(seen) and len(seen) == len(set(seen)) == 3012
        assert set(copies) <= set(seen)
        prefixed = catalog.list_envs(rt.ListEnvsRequest(prefix="Sample_0006_Iv0", page_size=1000))
        assert {e.env_id for e in prefixed.envs} == {c for c in copies if c.startswith("Sample_0006_Iv0")}
        tasks = {e.env_id: e.task_count for e in catalog.list_envs(rt.ListEnvsRequest(prefix=GCD)).envs}
        with Library(path) as library:
            assert tasks == {GCD: len(library.tasks_of(GCD))} and tasks[GCD] > 1
    finally:
        catalog.close()


# ---- served through a real runtime and real jails ----------------------------------------------

VARIANT_CONFIG = {"nums": [12, 18, 24]}


def add_variant_task(path: Path) -> str:
    """Record the GCD sample's task {"nums": [12, 18, 24]} as played with other code (its Observe
    answers "n=3", not "3"), as a published task row whose gym_env differs from the env table's;
    the config text is kept as published (compact, no spaces)."""
    db = sqlite3.connect(path)
    source, tools_json, tools_text = db.execute(
        "SELECT source, tools_json, tools_text FROM envs WHERE env_id = ?", (GCD,)
    ).fetchone()
    variant = source.replace("return str(len(self.nums))", 'return "n=" + str(len(self.nums))')
    assert variant != source
    sha = hashlib.sha256(variant.encode()).hexdigest()
    with db:
        db.execute(
            "INSERT INTO variants (sha256, env_id, source, tools_json, tools_text) VALUES (?, ?, ?, ?, ?)",
            (sha, GCD, variant, tools_json, tools_text),
        )
        changed = db.execute(
            "UPDATE tasks SET source_sha = ?, config_text = ? WHERE env_id = ? AND config_json = ?",
            (sha, '{"nums":[12,18,24]}', GCD, json.dumps(VARIANT_CONFIG)),
        ).rowcount
    db.close()
    assert changed == 1
    return sha


@pytest.fixture(scope="module")
def served(big_library: tuple[Path, list[str]]) -> Iterator[tuple[RuntimeClient, list[str]]]:
    path, copies = big_library
    add_variant_task(path)
    workers = start_workers(count=2, jails=1)
    runtime: CodegymServer | None = None
    try:
        # A record cache far smaller than the library: the records are read again and again.
        runtime = start_runtime(path, workers, "--env-cache-mb", "1")
        with RuntimeClient(runtime.address, timeout_s=60) as client:
            yield client, copies
    finally:
        if runtime is not None:
            assert runtime.stop() == 0
        for worker in workers:
            assert worker.stop() == 0


@pytest.mark.jail
def test_a_task_recorded_with_its_own_code_is_served_with_it_for_every_step(
    served: tuple[RuntimeClient, list[str]],
) -> None:
    client, _ = served
    recorded = client.create_session(ability=f'codegym_v1@{GCD}@{{"nums":[12,18,24]}}')
    other = client.create_session(env_id=GCD, config={"nums": [7, 13]})
    try:
        assert client.step(recorded.session_id, OBSERVE).observation == "n=3"
        assert client.step(other.session_id, OBSERVE).observation == "2"
        # Still the task's code after the runtime read many other environments (its cache is 1 MiB).
        for env_id in [GCD] + [f"Sample_0001_Iv{n:05d}__MaxSubarraySumEnv" for n in range(0, 600, 12)]:
            client.close_session(client.create_session(env_id=env_id, config={"nums": [1, 2]}).session_id)
        assert client.step(recorded.session_id, OBSERVE).observation == "n=3"
    finally:
        client.close_session(recorded.session_id)
        client.close_session(other.session_id)
    # GetEnv hands the config back as it was published, byte for byte.
    configs = [t.config_json for t in client.get_env(GCD).tasks]
    assert '{"nums":[12,18,24]}' in configs


@pytest.mark.jail
def test_environments_drawn_across_the_library_each_serve_their_own_code(
    served: tuple[RuntimeClient, list[str]],
) -> None:
    client, copies = served
    # Every twentieth copy of the GCD sample: each a source new to the workers and their jails.
    drawn = [c for c in copies if c.startswith("Sample_0006_Iv")][::20]
    assert len(drawn) >= 10
    for env_id in drawn:
        session = client.create_session(env_id=env_id, config={"nums": [4, 6]})
        try:
            assert session.env_id == env_id
            assert client.step(session.session_id, OBSERVE).observation == "2"
        finally:
            client.close_session(session.session_id)
    with pytest.raises(grpc.RpcError) as missing:
        client.create_session(env_id="Sample_0006_Iv99999__ArrayGcdEnv", config={"nums": [4, 6]})
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def sandbox_create(stub: sbg.SandboxServiceStub, source: str, *, with_code: bool) -> sb.OperationResult:
    """A create of `source`'s env, by sha256 alone unless `with_code`; its first Observe after."""
    sha = hashlib.sha256(source.encode()).hexdigest()
    op = sb.Operation(
        source=sb.SourceRef(sha256=sha, code=source if with_code else ""),
        limits=sb.Limits(wall_ms=10_000),
        seed=7,
        create=sb.CreateOp(config_json='{"nums": [4, 6, 9]}'),
    )
    result: sb.OperationResult = stub.Execute(sb.ExecuteRequest(operation=op), timeout=60).result
    return result


@pytest.mark.jail
def test_a_jail_whose_code_cache_is_full_forgets_by_bytes_and_still_serves_every_source() -> None:
    """A jail keeping almost no compiled code (`--code-cache-mb 0`: only the newest) answers exactly
    as a jail keeping everything, and says what it dropped, so the worker sends the text again."""
    sources = [(ENV_DIR / f"{GCD}.py").read_text() + f"\n# copy {n}\n" for n in range(4)] + [
        (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()
    ]
    order = [0, 1, 2, 0, 3, 4, 1, 0]
    answers = {}
    evictions = {}
    for name, cache_mb in (("tiny", "0"), ("default", "32")):
        worker = CodegymServer(
            [
                "serve",
                "sandbox",
                "--port",
                "0",
                "--jails",
                "1",
                "--code-cache-mb",
                cache_mb,
                "--metrics-port",
                "0",
            ]
        )
        try:
            with grpc.insecure_channel(worker.address) as channel:
                stub = sbg.SandboxServiceStub(channel)
                for source in sources:  # the worker caches each text (and its jail compiles it)
                    assert sandbox_create(stub, source, with_code=True).status == sb.STATUS_OK
                got = []
                for i in order:  # by sha256 alone: the worker decides whether the jail needs the text
                    result = sandbox_create(stub, sources[i], with_code=False)
                    assert result.status == sb.STATUS_OK, result.message
                    got.append((result.observation, result.env_class))
                answers[name] = got
            figures = scrape(metrics_address(worker))
            evictions[name] = figures.get(
                'codegym_cache_events_total{cache="jail_code",event="eviction"}', 0.0
            )
        finally:
            assert worker.stop() == 0
    assert answers["tiny"] == answers["default"]
    assert evictions["tiny"] >= len(order) and evictions["default"] == 0
