"""`codegym library import` reads everything CodeGym publishes, unchanged.

Nothing can be downloaded here, so each test writes the published forms itself (pyarrow for the
Hugging Face dataset's Parquet) from the sample environments: the dataset's snapshot layout
(`envs_en/`, `envs_cn/`, the card's older `data/envs_*.parquet`, `task_*/train-*.parquet`), the
pipeline's verified folder (step 5) and its env folder with training JSONL (step 6). Nothing here
runs environment code or starts a sandbox.
"""

from __future__ import annotations

import json
import sqlite3
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codegym.contract import parse_config, sha256_text, split_env_id
from codegym.library.importing import PYTHON, import_paths
from codegym.library.store import Library, canonical_config
from codegym_cli.cli import main
from tests.conftest import ENV_DIR

SAMPLE_IDS = sorted(p.stem for p in ENV_DIR.glob("*__*Env.py"))
EN_IDS = SAMPLE_IDS[:8]  # the English set
CN_IDS = SAMPLE_IDS[4:]  # the Chinese set: shares 4 keys with the English one, with other code
# Config texts as CodeGym writes them: spaced, compact, raw non-ASCII, escaped, key order, Python.
CONFIGS = [
    '{"nums": [3, 1, 2], "k": 2}',
    '{"nums":[4,5,6],"k":1}',
    '{"b": 1, "a": "héllo 你好"}',
    '{"s": "caf\\u00e9"}',
    "{'nums': [7, 8], 'flag': True}",
    '{"text": "a@b@c"}',
]
TEXT = pa.string()
TASK_SCHEMA = pa.schema(
    [
        ("ability", TEXT),
        ("answer", TEXT),
        ("code_id", TEXT),
        ("data_source", TEXT),
        ("prompt", pa.list_(pa.struct([("role", TEXT), ("content", TEXT), ("name", TEXT)]))),
        ("reward_model", pa.struct([("ground_truth", TEXT), ("style", TEXT)])),
        ("plugin_call_max_round", pa.int64()),
        (
            "extra_info",
            pa.struct(
                [
                    ("gym_env", TEXT),
                    ("std_traj", TEXT),
                    ("obs_traj", TEXT),
                    ("solve_fc_round", pa.int64()),
                    ("qwen32b_Bo4_score", pa.float64()),
                    ("qwen32b_Bo8_score", pa.float64()),
                    ("index", TEXT),
                    ("not_yet_published", TEXT),  # an extra_info key this library does not know
                ]
            ),
        ),
        ("curriculum_tag", TEXT),  # a column this library does not know
    ]
)


# ---- the published forms, written from the samples ----------------------------------------------


def source_of(env_id: str, lang: str = "en") -> str:
    """A sample's code as one of the sets publishes it; the first sample with CRLF line ends and no
    final newline (code is kept byte for byte), the Chinese set with a comment of its own."""
    text = (ENV_DIR / f"{env_id}.py").read_bytes().decode()
    if env_id == SAMPLE_IDS[0]:
        text = text.rstrip("\n").replace("\n", "\r\n")
    return text if lang == "en" else f"{text}\n# 中文版本：{env_id}\n"


def env_rows(env_ids: Iterable[str], lang: str) -> list[dict[str, Any]]:
    rows = []
    for env_id in env_ids:
        code_id, env_class = split_env_id(env_id)
        rows.append({"env_code": source_of(env_id, lang), "env_name": env_class, "source": code_id})
    return rows


def task_row(env_id: str, config: str, gym_env: str, index: int, **info: Any) -> dict[str, Any]:
    """A training-instance row as the dataset publishes it."""
    code_id, _ = split_env_id(env_id)
    return {
        "ability": f"codegym_v1@{env_id}@{config}",
        "answer": "There is no answer",
        "code_id": code_id,
        "data_source": "codegym_gym_v1",
        "prompt": [
            {"role": "system", "content": "\nFunction:\n\ndef Observe():\n", "name": "functions"},
            {"role": "user", "content": f"Protocol.\n\nQuestion:\n\n\nTask of {env_id}.\n", "name": ""},
        ],
        "reward_model": {"ground_truth": None, "style": "agent_env"},
        "plugin_call_max_round": 256,
        "extra_info": {
            "gym_env": gym_env,
            "std_traj": repr([{"name": "Observe", "parameters": {}}]),
            "obs_traj": repr([f"observation {index} ✓"]),
            "solve_fc_round": 10 + index % 7,
            "qwen32b_Bo4_score": 0.25,
            "qwen32b_Bo8_score": None,
            "index": str(index),
            **info,
        },
        "curriculum_tag": "warm-up" if index % 2 else None,
    }


def task_rows(env_ids: Iterable[str], lang: str, per_env: int = 2) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, env_id in enumerate(env_ids):
        for k in range(per_env):
            config = CONFIGS[(n + k) % len(CONFIGS)]
            rows.append(task_row(env_id, config, source_of(env_id, lang), len(rows)))
    return rows


def write_parquet(
    path: Path, rows: list[dict[str, Any]], schema: pa.Schema | None = None, **options: Any
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, **options)
    return path


def write_shards(
    folder: Path, rows: list[dict[str, Any]], shards: int, schema: pa.Schema | None = None
) -> None:
    size = -(-len(rows) // shards)
    for n in range(shards):
        part = rows[n * size : (n + 1) * size]
        write_parquet(folder / f"train-{n:05d}-of-{shards:05d}.parquet", part, schema)


def snapshot(root: Path) -> Path:
    """The dataset's folder as downloaded: both env sets, the card's older copy of them, and a task
    set for each (English tasks on English envs, English tasks on Chinese envs)."""
    write_shards(root / "envs_en", env_rows(EN_IDS, "en"), 1)
    write_shards(root / "envs_cn", env_rows(CN_IDS, "cn"), 1)
    write_parquet(root / "data" / "envs_en.parquet", env_rows(EN_IDS, "en"))
    write_parquet(root / "data" / "envs_cn.parquet", env_rows(CN_IDS, "cn"))
    write_shards(root / "task_en_instruction_en_env", task_rows(EN_IDS, "en"), 2, TASK_SCHEMA)
    write_shards(root / "task_en_instruction_cn_env", task_rows(CN_IDS, "cn", per_env=3), 2, TASK_SCHEMA)
    (root / "README.md").write_text("---\nlicense: cc-by-nc-4.0\n---\n")
    return root


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """`codegym library import ARGS --json`: the exit code and the report."""
    code = main(["library", "import", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def source(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in report["sources"] if s["source"].endswith(name))


def library_rows(db: Path) -> list[tuple[Any, ...]]:
    """Everything the library holds, for comparing two states."""
    with sqlite3.connect(db) as conn:
        return [
            *conn.execute("SELECT env_id, sha256, source, tools_json, task_text FROM envs ORDER BY env_id"),
            *conn.execute(
                "SELECT env_id, config_json, config_text, source_sha, scores, extra, solve_fc_round"
                " FROM tasks ORDER BY env_id, config_json"
            ),
            *conn.execute("SELECT sha256, env_id FROM variants ORDER BY sha256"),
            *conn.execute("SELECT std_traj, obs_traj FROM trajectories ORDER BY std_traj, obs_traj"),
        ]


def ability_of(env_id: str, config_text: str) -> str:
    return f"codegym_v1@{env_id}@{config_text}"


# ---- the Hugging Face dataset ---------------------------------------------------------------------


def test_one_env_set_and_its_tasks_import_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = snapshot(tmp_path / "CodeGym")
    db = tmp_path / "lib.db"
    parts = [snap / "envs_en", snap / "data" / "envs_en.parquet", snap / "task_en_instruction_en_env"]
    code, report = cli(capsys, *map(str, parts), "--library", str(db))
    assert code == 0, report
    envs, copy, tasks = (
        source(report, n) for n in ("envs_en", "envs_en.parquet", "task_en_instruction_en_env")
    )
    assert (
        envs["kind"] == "env table" and envs["rows"] == len(EN_IDS) and envs["envs"]["added"] == len(EN_IDS)
    )
    # The card's older copy is the same rows: duplicates of envs_en's, never counted twice.
    assert copy["rows"] == len(EN_IDS) and copy["envs"]["added"] == 0
    assert copy["envs"]["duplicates"] == {envs["source"]: len(EN_IDS)}
    published = task_rows(EN_IDS, "en")
    assert tasks["rows"] == len(published) and tasks["tasks"]["added"] == len(published)
    assert tasks["tasks"]["trajectories"] == len(published) and tasks["tasks"]["other_code"] == 0
    assert report["library"]["envs"] == len(EN_IDS) and report["library"]["tasks"] == len(published)

    with Library(db) as library:
        for env_id in EN_IDS:
            record = library.get(env_id, tasks=False)
            assert record is not None and record.source == source_of(env_id)  # byte for byte
            assert record.metadata["file"].endswith("envs_en/train-00000-of-00001.parquet")
            assert record.task_text == f"Task of {env_id}."  # from the prompt's question
        assert "\r\n" in library.get(EN_IDS[0], tasks=False).source  # type: ignore[union-attr]
        for row in published:
            env_id, config_text = row["ability"].split("@", 2)[1:]
            task = library.task(env_id, canonical_config(parse_config(config_text)))
            assert task is not None
            assert ability_of(env_id, task.published_config) == row["ability"]  # byte for byte
            assert task.source_sha == "" and task.solve_fc_round == row["extra_info"]["solve_fc_round"]
            assert task.scores == {"qwen32b_Bo4_score": 0.25}  # Bo8 is null: not measured
            kept = {
                k: v
                for k, v in row.items()
                if k not in ("ability", "extra_info", "code_id") and v is not None
            }
            assert task.extra == {**kept, "extra_info": {"index": row["extra_info"]["index"]}}
    with sqlite3.connect(db) as conn:
        trajectories = {std + obs for std, obs in conn.execute("SELECT std_traj, obs_traj FROM trajectories")}
    assert trajectories == {r["extra_info"]["std_traj"] + r["extra_info"]["obs_traj"] for r in published}
    texts = {t for (t,) in sqlite3.connect(db).execute("SELECT config_text FROM tasks")}
    # Only texts that are not already the canonical spelling are kept apart.
    assert texts == {"", '{"nums":[4,5,6],"k":1}', '{"s": "caf\\u00e9"}', "{'nums': [7, 8], 'flag': True}"}


def test_unknown_columns_and_extra_info_keys_are_kept(tmp_path: Path) -> None:
    env_id = EN_IDS[1]
    row = task_row(env_id, CONFIGS[0], source_of(env_id), 7, not_yet_published="new key")
    row["curriculum_tag"] = "late"
    write_parquet(tmp_path / "envs.parquet", env_rows([env_id], "en"))
    write_parquet(tmp_path / "tasks.parquet", [row], TASK_SCHEMA)
    with Library(tmp_path / "lib.db") as library:
        report = library.import_paths([tmp_path])
        task = library.task(env_id, canonical_config(parse_config(CONFIGS[0])))
    assert report.skipped == [] and report.tasks_added == 1
    assert task is not None
    assert task.extra["curriculum_tag"] == "late"
    assert task.extra["extra_info"] == {"index": "7", "not_yet_published": "new key"}
    assert "gym_env" not in json.dumps(task.extra) and "std_traj" not in json.dumps(task.extra)


def test_english_and_chinese_sets_collide_and_an_option_resolves_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = snapshot(tmp_path / "CodeGym")
    db = tmp_path / "lib.db"
    shared = sorted(set(EN_IDS) & set(CN_IDS))
    code, report = cli(capsys, str(snap), "--library", str(db))
    assert code == 1  # refused: which code a key serves is the operator's choice
    refused = [c for c in report["conflicts"] if c["resolution"] == "refused"]
    assert sorted(c["env_id"] for c in refused) == shared
    assert {(Path(c["file"]).parent.name, Path(c["other"]).parent.name) for c in refused} == {
        ("envs_en", "envs_cn")
    }
    # The older copies are duplicates (of their own set, the refused rows included), not conflicts.
    assert source(report, "data/envs_en.parquet")["envs"]["duplicates"] == {
        str(snap / "envs_en"): len(EN_IDS)
    }
    assert source(report, "data/envs_cn.parquet")["envs"]["duplicates"] == {
        str(snap / "envs_cn"): len(CN_IDS)
    }
    assert report["library"]["envs"] == len(set(EN_IDS) | set(CN_IDS))
    with Library(db) as library:
        for env_id in shared:  # never overwritten: the first set read keeps its code
            assert library.get(env_id, tasks=False).source == source_of(env_id, "cn")  # type: ignore[union-attr]
        # English tasks on a key holding the Chinese code keep the English code they were recorded with.
        en_tasks = source(report, "task_en_instruction_en_env")["tasks"]
        assert en_tasks["other_code"] == 2 * len(shared) and en_tasks["added"] == 2 * len(EN_IDS)
        task = library.task(shared[0], canonical_config(parse_config(CONFIGS[4 % len(CONFIGS)])))
        assert task is not None and task.source_sha == sha256_text(source_of(shared[0], "en"))
        variant = library.variant(task.source_sha)
        assert variant is not None and variant.source == source_of(shared[0], "en")
        assert variant.tool_names == library.get(shared[0], tasks=False).tool_names  # type: ignore[union-attr]

    code, report = cli(capsys, str(snap), "--library", str(db), "--on-conflict", "keep")
    assert code == 0 and {c["resolution"] for c in report["conflicts"]} == {"kept"}
    assert report["tasks"]["added"] == 0

    code, report = cli(capsys, str(snap), "--library", str(db), "--on-conflict", "replace")
    assert code == 0 and sorted(c["env_id"] for c in report["conflicts"]) == shared
    assert source(report, "envs_en")["envs"]["updated"] == len(shared)
    with Library(db) as library:
        for env_id in shared:
            assert library.get(env_id, tasks=False).source == source_of(env_id, "en")  # type: ignore[union-attr]
        # The English tasks now have their env's code; the Chinese-env tasks keep theirs.
        en = library.task(shared[0], canonical_config(parse_config(CONFIGS[4 % len(CONFIGS)])))
        assert en is not None and en.source_sha == ""
        # The Chinese-env tasks were recorded with the code replaced: they keep it.
        kept = [
            t for t in library.tasks_of(shared[0]) if t.source_sha == sha256_text(source_of(shared[0], "cn"))
        ]
        assert len(kept) == 3


def test_a_changed_env_file_is_a_conflict_and_replace_keeps_recorded_tasks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    envs = tmp_path / "envs"
    envs.mkdir()
    env_id = SAMPLE_IDS[2]
    original = source_of(env_id)
    (envs / f"{env_id}.py").write_text(original, newline="")
    training = tmp_path / "training.jsonl"
    training.write_text(json.dumps(task_row(env_id, CONFIGS[0], original, 0)) + "\n")
    db = tmp_path / "lib.db"
    assert cli(capsys, str(envs), str(training), "--library", str(db))[0] == 0

    changed = original + "\n# fixed a bug\n"
    (envs / f"{env_id}.py").write_text(changed, newline="")
    plain = tmp_path / "plain.jsonl"  # a config with no recording follows the env's code
    plain.write_text(json.dumps({"env_id": env_id, "config": {"nums": [9]}}) + "\n")
    code, report = cli(capsys, str(envs), str(plain), "--library", str(db))
    assert code == 1 and [c["resolution"] for c in report["conflicts"]] == ["refused"]
    assert report["conflicts"][0]["file"] == report["conflicts"][0]["other"] == f"{env_id}.py"
    with Library(db) as library:
        assert library.get(env_id, tasks=False).source == original  # type: ignore[union-attr]

    code, report = cli(capsys, str(envs), "--library", str(db), "--on-conflict", "replace")
    assert code == 0 and report["envs"]["updated"] == 1
    with Library(db) as library:
        assert library.get(env_id, tasks=False).source == changed  # type: ignore[union-attr]
        recorded = library.task(env_id, canonical_config(parse_config(CONFIGS[0])))
        unrecorded = library.task(env_id, canonical_config({"nums": [9]}))
        assert recorded is not None and recorded.source_sha == sha256_text(original)
        assert unrecorded is not None and unrecorded.source_sha == ""
        assert library.source_of(sha256_text(original)) == original


def test_a_task_row_whose_env_is_missing_brings_it(tmp_path: Path) -> None:
    env_id = SAMPLE_IDS[3]
    rows = [task_row(env_id, CONFIGS[n], source_of(env_id), n) for n in range(3)]
    write_parquet(tmp_path / "task_x" / "train-00000-of-00001.parquet", rows, TASK_SCHEMA)
    with Library(tmp_path / "lib.db") as library:
        report = library.import_paths([tmp_path / "task_x"])
        record = library.get(env_id)
    assert report.added == [env_id] and report.tasks_added == 3 and report.skipped == []
    assert record is not None and record.source == source_of(env_id) and len(record.tasks) == 3
    assert all(t.source_sha == "" for t in record.tasks)


def test_code_this_python_cannot_compile_is_skipped_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken_id = SAMPLE_IDS[5]
    broken = source_of(broken_id).replace("def reset(", 'print "py2"\n    def reset(', 1)
    rows = env_rows(SAMPLE_IDS[:5], "en")
    rows.append(
        {"env_code": broken, "env_name": split_env_id(broken_id)[1], "source": split_env_id(broken_id)[0]}
    )
    write_parquet(tmp_path / "envs_en" / "train-00000-of-00001.parquet", rows)
    tasks = task_rows(SAMPLE_IDS[:5], "en") + [
        task_row(broken_id, CONFIGS[n], broken, 99 + n) for n in range(3)
    ]
    write_shards(tmp_path / "task_en_instruction_en_env", tasks, 1, TASK_SCHEMA)
    db = tmp_path / "lib.db"
    code, report = cli(capsys, str(tmp_path), "--library", str(db))
    assert code == 0  # skipped and counted, never fatal
    envs, task_source = source(report, "envs_en"), source(report, "task_en_instruction_en_env")
    [(reason, skips)] = envs["skipped"].items()
    assert reason == f"does not compile on Python {PYTHON}" and skips["count"] == 1
    assert broken_id in skips["examples"][0][1] and "line" in skips["examples"][0][1]
    # Its task rows carry the same code: skipped for the same reason (checked once), counted.
    assert task_source["skipped"][reason]["count"] == 3 and task_source["tasks"]["added"] == 10
    assert report["skipped"] == 4 and report["library"]["envs"] == 5
    assert main(["library", "import", str(tmp_path), "--library", str(db), "--strict", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "4 skipped" in out and f"does not compile on Python {PYTHON}" in err


def test_reimporting_adds_nothing_and_counts_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = snapshot(tmp_path / "CodeGym")
    db = tmp_path / "lib.db"
    args = [str(snap), "--library", str(db), "--on-conflict", "keep"]
    code, first = cli(capsys, *args)
    state = library_rows(db)
    code2, second = cli(capsys, *args)
    assert code == code2 == 0 and library_rows(db) == state
    assert second["envs"]["added"] == second["tasks"]["added"] == 0
    assert second["envs"]["unchanged"] == first["envs"]["added"]
    assert second["tasks"]["present"] == first["tasks"]["added"]
    for a, b in zip(first["sources"], second["sources"], strict=True):
        assert (a["source"], a["rows"], a["skipped"]) == (b["source"], b["rows"], b["skipped"])
        assert (
            a["envs"]["duplicates"] == b["envs"]["duplicates"]
            and a["envs"]["conflicts"] == b["envs"]["conflicts"]
        )
        assert a["tasks"]["added"] + a["tasks"]["present"] == b["tasks"]["present"]
        assert a["tasks"]["other_code"] == b["tasks"]["other_code"]


def test_an_import_broken_off_by_a_corrupt_shard_is_completed_by_running_it_again(tmp_path: Path) -> None:
    write_shards(tmp_path / "envs_en", env_rows(SAMPLE_IDS, "en"), 1)
    rows = [
        task_row(env_id, json.dumps({"k": k}), source_of(env_id), n * 40 + k)
        for n, env_id in enumerate(SAMPLE_IDS)
        for k in range(40)
    ]
    folder = tmp_path / "task_en_instruction_en_env"
    shards = [folder / f"train-{n:05d}-of-00003.parquet" for n in range(3)]
    write_parquet(shards[0], rows[:100], TASK_SCHEMA)
    # The middle shard in small row groups, one of them damaged past its first 200 rows.
    write_parquet(shards[1], rows[100:400], TASK_SCHEMA, row_group_size=20, compression="zstd")
    good = shards[1].read_bytes()
    chunk = pq.read_metadata(shards[1]).row_group(12).column(0)
    damaged = bytearray(good)
    start = chunk.data_page_offset + chunk.total_compressed_size // 2
    damaged[start : start + 16] = bytes(16)
    shards[1].write_bytes(bytes(damaged))
    # And the last one cut short, as a download that stopped.
    write_parquet(shards[2], rows[400:], TASK_SCHEMA)
    last_good = shards[2].read_bytes()
    shards[2].write_bytes(last_good[: len(last_good) // 2])

    db = tmp_path / "lib.db"
    with Library(db) as library:
        first = library.import_paths([tmp_path])
        _, held = library.counts()
    reasons = dict(first.skipped)
    assert reasons.keys() == {str(shards[1]), str(shards[2])}
    # The first shard and the middle one's batches before the damage, each committed.
    assert 100 < held < 100 + 240, held
    assert reasons[str(shards[1])].startswith(f"unreadable file: after {held - 100} rows")
    assert "unreadable file" in reasons[str(shards[2])]

    shards[1].write_bytes(good)
    shards[2].write_bytes(last_good)
    with Library(db) as library:
        second = library.import_paths([tmp_path])
        assert library.counts() == (len(SAMPLE_IDS), len(rows))
    assert second.skipped == [] and second.tasks_added == len(rows) - held and second.tasks_present == held


# ---- CodeGym's own pipeline outputs ---------------------------------------------------------------


def test_the_pipelines_verified_folder_and_training_data_import(tmp_path: Path) -> None:
    verified = tmp_path / "codegym_env_verified"
    verified.mkdir()
    shapes: dict[str, list[Any]] = {
        # Step 5 writes the unit tests it verified: the env string, its answer, its oracle's rounds.
        SAMPLE_IDS[0]: [
            {"unit_test": f"{split_env_id(SAMPLE_IDS[0])[1]}@{c}", "ref_answer": 3, "solve_fc_round": 12 + n}
            for n, c in enumerate(CONFIGS[:3])
        ],
        SAMPLE_IDS[1]: [f"{split_env_id(SAMPLE_IDS[1])[1]}@{CONFIGS[1]}", CONFIGS[2]],  # strings
        SAMPLE_IDS[2]: [{"nums": [1, 2]}, {"config": '{"nums":[3]}', "difficulty": "hard"}],  # configs
    }
    for env_id, tests in shapes.items():
        code_id, env_name = split_env_id(env_id)
        item = {
            "code_id": code_id,
            "idx": 0,
            "env_name": env_name,
            "gym_env": source_of(env_id),
            "gym_task": f"Task of {env_id}.",
            "docstring": "...",
            "unit_test_list": tests,
        }
        (verified / f"{env_id}.json").write_text(json.dumps(item, ensure_ascii=False))
    # Step 6: the env folder and the training data (extra_info carries gym_env).
    synth = tmp_path / "codegym_synth_env"
    synth.mkdir()
    env_id = SAMPLE_IDS[3]
    (synth / f"{env_id}.py").write_text(source_of(env_id), newline="")
    training = tmp_path / "codegym_training_data.jsonl"
    lines = [task_row(env_id, CONFIGS[n], source_of(env_id), n) for n in range(4)]
    training.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))

    with Library(tmp_path / "lib.db") as library:
        report = library.import_paths([verified, synth, training])
        assert report.skipped == [] and sorted(report.added) == sorted([*shapes, env_id])
        for env, tests in shapes.items():
            record = library.get(env)
            assert (
                record is not None
                and record.source == source_of(env)
                and record.task_text == f"Task of {env}."
            )
            assert len(record.tasks) == len(tests)
        code_id = split_env_id(SAMPLE_IDS[0])[0]
        for test, task in zip(shapes[SAMPLE_IDS[0]], library.tasks_of(SAMPLE_IDS[0]), strict=True):
            # Step 6 builds the ability as codegym_v1@{code_id}__{unit_test}: it round-trips.
            assert f"codegym_v1@{code_id}__{test['unit_test']}" == ability_of(
                SAMPLE_IDS[0], task.published_config
            )
            assert task.solve_fc_round == test["solve_fc_round"] and task.extra == {"ref_answer": 3}
        hard = library.task(SAMPLE_IDS[2], canonical_config({"nums": [3]}))
        assert hard is not None and hard.difficulty == "hard" and hard.published_config == '{"nums":[3]}'
        for line in lines:
            task = library.task(env_id, canonical_config(parse_config(line["ability"].split("@", 2)[2])))
            assert task is not None and ability_of(env_id, task.published_config) == line["ability"]
            assert task.source_sha == ""


# ---- streaming --------------------------------------------------------------------------------------


def test_task_shards_are_read_a_batch_at_a_time(tmp_path: Path) -> None:
    """A shard of rows with large trajectories: holding it would take 80 MB of Python strings."""
    env_id = SAMPLE_IDS[4]
    write_parquet(tmp_path / "envs.parquet", env_rows([env_id], "en"))
    rows = []
    for n in range(640):
        row = task_row(env_id, json.dumps({"n": n}), source_of(env_id), n)
        row["extra_info"]["obs_traj"] = repr([f"{n:06d}" * 20_000])  # 120 KB
        rows.append(row)
    write_shards(tmp_path / "task_big", rows, 1, TASK_SCHEMA)
    db = sqlite3.connect(tmp_path / "lib.db")
    with Library(tmp_path / "lib.db"):
        pass  # the schema
    tracemalloc.start()
    try:
        report = import_paths(db, [tmp_path])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.tasks_added == len(rows) and report.skipped == []
    # A batch of 128 rows is 15 MB: one batch held at a time, not the shard, nor two batches.
    assert peak < 24 * 2**20, f"peak Python allocations {peak / 2**20:.1f} MiB"


def test_library_list_pages_through_the_library(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "lib.db"
    with Library(db) as library:
        library.import_paths([ENV_DIR])

    def whole_library(self: Library) -> None:
        raise AssertionError("list read the whole library")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Library, "load_all", whole_library)
        assert main(["library", "list", "--library", str(db), "--json"]) == 0
    listed = [json.loads(line)["env_id"] for line in capsys.readouterr().out.splitlines()]
    assert listed == SAMPLE_IDS


@pytest.mark.slow  # generates and imports a few thousand environments: 30 s idle, minutes on a busy machine
@pytest.mark.timeout(900)
def test_thousands_of_generated_environments_import_in_bounded_memory(tmp_path: Path) -> None:
    """The published layout at a scale: each env a sample plus a unique comment (its own code),
    under its own `source`; 3.5 task rows an env, as published, with their recordings."""
    count = 3000
    envs, tasks = [], []
    for n in range(count):
        env_id = SAMPLE_IDS[n % len(SAMPLE_IDS)]
        code_id, env_class = split_env_id(env_id)
        code = f"{source_of(env_id)}\n# generated variant {n:05d}\n"
        envs.append({"env_code": code, "env_name": env_class, "source": f"{code_id}_v{n:05d}"})
        for k in range(3 + n % 2):
            tasks.append(task_row(f"{code_id}_v{n:05d}__{env_class}", json.dumps({"k": k}), code, len(tasks)))
    write_shards(tmp_path / "envs_en", envs, 2)
    write_shards(tmp_path / "task_en_instruction_en_env", tasks, 3, TASK_SCHEMA)
    del envs, tasks
    db = sqlite3.connect(tmp_path / "lib.db")
    with Library(tmp_path / "lib.db"):
        pass
    tracemalloc.start()
    try:
        report = import_paths(db, [tmp_path])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.skipped == [] and len(report.added) == count and report.tasks_added == count * 7 // 2
    # The rows alone are over 100 MB as Python strings (their code, prompts and recordings).
    assert peak < 32 * 2**20, f"peak Python allocations {peak / 2**20:.1f} MiB"
    assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == count * 7 // 2
