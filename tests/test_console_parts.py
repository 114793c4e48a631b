"""The console's parts that need no server (issue #40): forms from tool schemas and the actions they
post, logins (unknown and service tokens refused, bounded, lapsing), CSRF checks, play transcripts
(owner-only, bounded, cut at a step back), redirect targets, plots, highlighting, and templates that
escape what they show. The pages themselves are driven in a browser (test_console_browser.py)."""

from __future__ import annotations

import json

import pytest

from codegym.server.auth import OPERATOR, SERVICE, TRAINER, Identity
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.console import access, curriculum, plots
from services.console.access import LoginRefused, Logins, csrf_ok
from services.console.app import Console, safe_next
from services.console.config import ConsoleConfig
from services.console.highlight import highlight
from services.console.plays import Play, Plays, Turn
from services.console.schemas import BadForm, parameters, tool_form

SCHEMA = json.dumps(
    {
        "type": "function",
        "function": {
            "name": "Pick",
            "description": "Pick things.",
            "parameters": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer", "description": "where"},
                    "weight": {"type": "number"},
                    "label": {"type": "string"},
                    "strict": {"type": "boolean"},
                    "items": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["index", "items"],
            },
        },
    }
)
TOKENS = {"t": Identity("team-a", TRAINER), "o": Identity("ops", OPERATOR), "s": Identity("svc", SERVICE)}


def test_a_form_has_a_field_of_each_parameters_type_and_posts_typed_parameters() -> None:
    form = tool_form("Pick", SCHEMA)
    assert [(f.name, f.kind, f.required) for f in form.fields] == [
        ("index", "integer", True),
        ("weight", "number", False),
        ("label", "string", False),
        ("strict", "boolean", False),
        ("items", "json", True),
    ]
    posted = {"p.index": "3", "p.weight": "", "p.label": "a b", "p.strict": "on", "p.items": "[1, 2]"}
    assert parameters(form, posted) == {"index": 3, "label": "a b", "strict": True, "items": [1, 2]}


@pytest.mark.parametrize(
    ("field", "value"), [("p.index", "three"), ("p.items", "[1,"), ("p.weight", "heavy")]
)
def test_a_field_that_does_not_parse_is_named(field: str, value: str) -> None:
    posted = {"p.index": "1", "p.items": "[]", field: value}
    with pytest.raises(BadForm, match=field.removeprefix("p.")):
        parameters(tool_form("Pick", SCHEMA), posted)


def test_an_unreadable_schema_gives_a_form_without_fields() -> None:
    form = tool_form("Odd", "{not json")
    assert form.fields == [] and form.schema_text == "{not json"


def test_logins_refuse_unknown_and_service_tokens_and_keep_only_an_operators_token() -> None:
    logins = Logins(TOKENS)
    with pytest.raises(LoginRefused, match="does not know"):
        logins.sign_in("nope")
    with pytest.raises(LoginRefused, match="service"):
        logins.sign_in("s")
    trainer_id, trainer = logins.sign_in("t")
    operator_id, operator = logins.sign_in(" o ")
    assert (trainer.tenant, trainer.token, trainer.operator) == ("team-a", "", False)
    assert (operator.tenant, operator.token, operator.operator) == ("", "o", True)
    assert logins.find(trainer_id) is trainer and logins.find("forged") is None
    logins.sign_out(trainer_id)
    assert logins.find(trainer_id) is None and logins.find(operator_id) is operator


def test_logins_are_bounded_and_lapse(monkeypatch: pytest.MonkeyPatch) -> None:
    logins = Logins(TOKENS, max_logins=2)
    first, _ = logins.sign_in("t")
    second, _ = logins.sign_in("t")
    third, _ = logins.sign_in("t")
    assert logins.find(first) is None and logins.find(second) and logins.find(third)
    monkeypatch.setattr(access, "LOGIN_TTL_S", -1.0)
    lapsed, _ = logins.sign_in("t")
    assert logins.find(lapsed) is None


def test_without_tokens_everyone_is_an_anonymous_operator_with_a_csrf_token() -> None:
    logins = Logins({})
    assert not logins.required
    _, login = logins.sign_in("")
    assert login.operator and login.token == "" and login.tenant == ""
    assert csrf_ok(login, login.csrf) and not csrf_ok(login, "") and not csrf_ok(login, login.csrf[:-1])


def play(owner: str, turns: list[Turn]) -> Play:
    return Play("s1", owner, "E", "task", "{}", "reset", [], 10, turns)


def test_transcripts_are_their_owners_and_bounded() -> None:
    plays = Plays(max_plays=1)
    plays.add(play("team-a", []))
    assert plays.find("s1", "team-a", operator=False) is not None
    assert plays.find("s1", "team-b", operator=False) is None
    assert plays.find("s1", "", operator=True) is not None
    plays.add(Play("s2", "team-a", "E", "", "{}", "", [], 10))
    assert plays.find("s1", "team-a", operator=False) is None  # the oldest went


def test_a_step_back_keeps_the_turns_before_the_committed_step() -> None:
    turns = [
        Turn(0, "a", "1", 0.0, False, False),
        Turn(1, "b", "", 0.0, False, False, error="bad"),  # failed: not committed
        Turn(2, "c", "2", 0.0, False, False),
        Turn(3, "d", "done", 1.0, True, False),
    ]
    plays = Plays()
    source = play("team-a", turns)
    fork = plays.rewound(source, "s9", at_step=2)
    assert [t.action for t in fork.turns] == ["a", "b", "c"] and fork.committed == 2
    assert fork.forked_from == "s1" and not fork.over and source.over


@pytest.mark.parametrize(
    ("target", "kept"),
    [
        ("/episodes?run=a", True),
        ("//evil.example/x", False),
        ("https://evil.example", False),
        ("/\\evil", False),
    ],
)
def test_a_redirect_after_sign_in_stays_inside_the_console(target: str, kept: bool) -> None:
    assert safe_next(target) == (target if kept else "/library")


def test_bars_scale_to_the_tallest_and_a_histogram_counts_one_in_the_last_bin() -> None:
    chart = plots.bar_chart("t", [("a", 1.0), ("b", 4.0)])
    assert [round(bar.height) for bar in chart.bars] == [round((plots.BASE - 20) / 4), plots.BASE - 20]
    counts = [bar.value for bar in plots.histogram("h", [0.0, 0.05, 0.5, 1.0], bins=10).bars]
    assert counts == ["2", "0", "0", "0", "0", "1", "0", "0", "0", "1"]


def test_stacked_columns_stand_on_the_base_and_scale_to_the_tallest_column() -> None:
    chart = plots.stacked_chart(
        "s", [("1", [("learnable", 1.0), ("mastered", 1.0)]), ("2", [("learnable", 4.0)])]
    )
    first, second = chart.columns
    assert [bar.label for bar in first.segments] == ["1:learnable", "1:mastered"]
    assert first.segments[0].y + first.segments[0].height == plots.BASE  # bottom first
    assert first.segments[1].y + first.segments[1].height == pytest.approx(first.segments[0].y)
    assert second.segments[0].height == plots.BASE - 20
    assert sum(bar.height for bar in first.segments) == pytest.approx((plots.BASE - 20) / 2)


def test_history_rows_count_the_unseen_from_the_library_and_each_pools_change() -> None:
    points = [
        rt.RunHistoryPoint(policy_version=2, at=1.0, played=3, learnable=3),
        rt.RunHistoryPoint(policy_version=7, at=2.0, played=4, learnable=1, mastered=2, unsolved=1),
    ]
    rows = curriculum.version_rows(points, total=100)
    assert [row.version for row in rows] == [2, 7]
    assert rows[0].pools == {"unseen": 97, "learnable": 3, "mastered": 0, "unsolved": 0}
    assert rows[0].change == {"learnable": 3, "mastered": 0, "unsolved": 0}
    assert rows[1].pools["unseen"] == 96
    assert rows[1].change == {"learnable": -2, "mastered": 2, "unsolved": 1}


def history_with_groups() -> list[rt.RunHistoryPoint]:
    """Two versions: 4 groups of 2+ episodes of which 3 zero-variance and 2 tasks moved; then 2
    groups, none zero-variance, a task unsolved to learnable."""
    return [
        rt.RunHistoryPoint(
            policy_version=2,
            at=1.0,
            played=3,
            learnable=3,
            groups=5,
            multi_episode_groups=4,
            zero_variance_groups=3,
            moves=[
                rt.PoolMove(from_pool="unseen", to_pool="learnable", tasks=1),
                rt.PoolMove(from_pool="unseen", to_pool="mastered", tasks=2),
            ],
        ),
        rt.RunHistoryPoint(
            policy_version=7,
            at=2.0,
            played=3,
            learnable=3,
            groups=2,
            multi_episode_groups=2,
            zero_variance_groups=0,
            moves=[rt.PoolMove(from_pool="unsolved", to_pool="learnable", tasks=1)],
        ),
    ]


def test_history_rows_carry_each_versions_groups_zero_variance_share_and_moves() -> None:
    first, second = curriculum.version_rows(history_with_groups(), total=100)
    assert (first.groups, first.multi, first.zero, first.zero_share) == (5, 4, 3, 0.75)
    assert first.moves == [("unseen", "mastered", 2), ("unseen", "learnable", 1)] and first.moved == 3
    assert (second.zero_share, second.moved) == (0.0, 1)
    alone = curriculum.version_rows([rt.RunHistoryPoint(policy_version=1, groups=1)], total=1)[0]
    assert alone.zero_share is None  # a group of one episode has no variance to speak of


def test_the_curriculum_page_shows_the_zero_variance_share_and_moves_per_version_escaped() -> None:
    console = Console(ConsoleConfig(runtime="127.0.0.1:1"))
    evil = "<script>alert(1)</script>"
    task = rt.TaskStats(ability=evil, env_id=evil, episodes=4, passes=4, pass_rate=1.0, pool="mastered")
    task.prior_pass_rate = 0.0
    versions = curriculum.version_rows(history_with_groups(), total=100)
    groups = curriculum.groups_of(versions)
    assert [(b.label, b.value) for b in groups.zero_chart.bars] == [("2", "75%"), ("7", "0%")]
    assert groups.zero_chart.bars[0].height == pytest.approx((plots.BASE - 20) * 0.75)  # a share of 1.0
    assert groups.zero_share == pytest.approx(3 / 6) and (groups.groups, groups.multi) == (7, 6)
    into = {b.label: b.value for column in groups.moves_chart.columns for b in column.segments}
    assert into == {
        "2:learnable": "1",
        "2:mastered": "2",
        "2:unsolved": "0",
        "7:learnable": "1",
        "7:mastered": "0",
        "7:unsolved": "0",
    }
    view = curriculum.CurriculumView(
        pools={"unseen": 97, "learnable": 3, "mastered": 0, "unsolved": 0},
        played=3,
        pool_chart=plots.bar_chart("pools", [("unseen", 97.0)]),
        pass_rates=plots.bar_chart("rates", [("1", 3.0)]),
        versions=versions,
        listed=versions,
        version_chart=plots.stacked_chart("versions", []),
        groups=groups,
        history_note="",
        per_task=curriculum.per_task([task]),
    )
    _, login = Logins({}).sign_in("")
    html = console.templates.get_template("curriculum.html").render(
        run_id=evil, view=view, login=login, page="curriculum", signin=False, grafana_url="", path="/"
    )
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "not shown" not in html and 'id="zero-variance">50%</b> of 6 groups of two episodes' in html
    assert '<tr data-version="2"><td>2</td><td>5</td><td>4</td><td>3</td><td>75%</td></tr>' in html
    assert 'data-move="unsolved>learnable" data-tasks="1"' in html
    assert 'id="zero-variance-chart"' in html and 'id="moves-chart"' in html


def test_highlighting_keeps_the_code_as_text() -> None:
    code = "def f():\n    return '<script>'  # x\n"
    pieces = highlight(code)
    assert "".join(p.text for p in pieces) == code
    assert {"k", "s", "c"} <= {p.css for p in pieces}


def test_templates_escape_what_they_show() -> None:
    console = Console(ConsoleConfig(runtime="127.0.0.1:1"))
    template = console.templates.get_template("episode.html")
    evil = "<script>alert(1)</script>"

    class Summary:
        episode_id, env_id, run_id, tenant, policy_version = evil, evil, evil, evil, 1
        steps, reward, end_reason, done, flagged, whole = 1, 1.0, evil, True, True, True

    class Step:
        index, action, observation, reward, done, truncated, error = 0, evil, evil, 1.0, True, False, evil

    class Episode:
        summary, config_json, first_observation, steps = Summary(), evil, evil, [Step()]

    _, login = Logins({}).sign_in("")
    html = template.render(
        episode=Episode(), login=login, page="episode", signin=False, grafana_url="", path="/"
    )
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
