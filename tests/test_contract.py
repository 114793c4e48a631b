"""The environment contract: static parsing, rendering, env strings, answers, safety scan."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionToolParam
from pydantic import TypeAdapter

from codegym.contract import (
    ContractError,
    EnvStringError,
    analyze_source,
    answers_equal,
    canonical_json,
    format_ability,
    parse_ability,
    parse_env_source,
    parse_env_str,
    scan_source,
    tools_schema,
    tools_text,
)
from tests.conftest import ENV_DIR, FIXTURE_ENVS, sample_env_paths, training_instances


@pytest.mark.parametrize("instance", training_instances(), ids=lambda d: d["code_id"])
def test_text_rendering_reproduces_training_instance_system_message(instance: dict) -> None:
    ability = parse_ability(instance["ability"])
    spec = parse_env_source((FIXTURE_ENVS / f"{ability.env_id}.py").read_text())
    assert spec.class_name == ability.env_class
    assert tools_text(spec) == instance["prompt"][0]["content"]


def test_json_schemas_validate_as_openai_tools() -> None:
    import jsonschema  # a dev dependency (pyproject.toml): missing, the test fails rather than skips

    adapter = TypeAdapter(ChatCompletionToolParam)
    for path in [*sample_env_paths(), *FIXTURE_ENVS.glob("*.py")]:
        for tool in tools_schema(parse_env_source(path.read_text())):
            adapter.validate_python(tool)
            jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
            assert tool["function"]["description"], (
                f"{path.name}: {tool['function']['name']} has no description"
            )


def test_schema_types_come_from_annotations_and_args_lines() -> None:
    spec = parse_env_source((FIXTURE_ENVS / "Codeforces_38402_I__MaxGCDAfterDivideEnv.py").read_text())
    by_name = {t["function"]["name"]: t["function"] for t in tools_schema(spec)}
    gcd = by_name["CalculateGCD"]["parameters"]
    assert gcd["properties"]["array"] == {
        "type": "array",
        "items": {"type": "integer"},
        "description": "The array for which to calculate the GCD.",
    }
    assert gcd["required"] == ["array"]
    # Done(answer) has no annotation: the type comes from "answer (int): ..."
    assert by_name["Done"]["parameters"]["properties"]["answer"]["type"] == "integer"
    assert by_name["Observe"]["parameters"] == {"type": "object", "properties": {}, "required": []}


def test_defaults_make_parameters_optional() -> None:
    source = (FIXTURE_ENVS / "Codeforces_38402_I__MaxGCDAfterDivideEnv.py").read_text()
    source = source.replace(
        "def SetCandidateGCD(self, value: int):", "def SetCandidateGCD(self, value: int = 0):"
    )
    spec = parse_env_source(source)
    schema = next(t for t in tools_schema(spec) if t["function"]["name"] == "SetCandidateGCD")
    assert schema["function"]["parameters"]["required"] == []
    # the def line is shown as written, as CodeGym shows it
    assert "def SetCandidateGCD(value: int = 0):" in tools_text(spec)


def test_text_rendering_keeps_return_annotations() -> None:
    plain = (ENV_DIR / "Sample_0006_I__ArrayGcdEnv.py").read_text()
    annotated = plain.replace("def Observe(self):", "def Observe(self) -> str:", 1).replace(
        "def Done(self, answer: int):", "def Done(self, answer: int) -> str:", 1
    )
    assert annotated.count(" -> str:") == plain.count(" -> str:") + 2
    spec = parse_env_source(annotated)
    observe, done = spec.tool("Observe"), spec.tool("Done")
    assert observe is not None and done is not None
    assert (observe.signature, observe.returns) == ("", "str")
    assert (done.signature, done.returns) == ("answer: int", "str")
    text = tools_text(spec)
    assert "def Observe() -> str:\n" in text
    assert "def Done(answer: int) -> str:\n" in text
    # methods without a return annotation render exactly as before
    get_element = spec.tool("GetElement")
    assert get_element is not None and get_element.returns == ""
    assert "def GetElement(index: int):\n" in text
    plain_text = tools_text(parse_env_source(plain))
    assert "def Observe():\n" in plain_text and "def Done(answer: int):\n" in plain_text
    assert text.replace(") -> str:\n", "):\n") == plain_text
    # the JSON schema does not depend on the return annotation
    assert tools_schema(spec) == tools_schema(parse_env_source(plain))


def _codes(source: str) -> list[str]:
    return [v.code for v in analyze_source(source).violations]


def test_every_sample_env_meets_the_contract() -> None:
    paths = sample_env_paths()
    assert len(paths) >= 12
    for path in paths:
        spec = analyze_source(path.read_text())
        assert spec.ok, f"{path.name}: {spec.violations}"
        assert len(spec.tools) >= 4
        assert path.stem.endswith("__" + spec.class_name)


def test_syntax_error_names_the_line(good_source: str) -> None:
    broken = good_source.replace("def Observe(self):", "def Observe(self)", 1)
    spec = analyze_source(broken)
    assert [v.code for v in spec.violations] == ["syntax_error"]
    line = next(i for i, text in enumerate(broken.splitlines(), 1) if "def Observe(self)" in text)
    assert spec.violations[0].line == line
    with pytest.raises(ContractError, match=f"line {line}: syntax error"):
        parse_env_source(broken)


def test_no_env_class(good_source: str) -> None:
    assert _codes(good_source.replace("(gymnasium.Env)", "(object)")) == ["no_env_class"]


def test_several_env_classes(good_source: str) -> None:
    twice = good_source + "\n\nclass OtherEnv(gymnasium.Env):\n    pass\n"
    spec = analyze_source(twice)
    assert [v.code for v in spec.violations] == ["several_env_classes"]
    assert "MaxSubarraySumEnv" in spec.violations[0].message and "OtherEnv" in spec.violations[0].message


def test_func_mapping_missing(good_source: str) -> None:
    assert "func_mapping_missing" in _codes(good_source.replace("self.func_mapping = {", "self.tools = {"))


def test_func_mapping_not_a_dict_literal(good_source: str) -> None:
    start = good_source.index("self.func_mapping = {")
    end = good_source.index("}", start) + 1
    source = good_source[:start] + "self.func_mapping = dict(Observe=0, Done=4)" + good_source[end:]
    assert _codes(source) == ["func_mapping_not_dict"]


def test_tool_without_method(good_source: str) -> None:
    source = good_source.replace('"Done": self.DONE,', '"Done": self.DONE,\n            "Teleport": 9,')
    spec = analyze_source(source)
    assert [v.code for v in spec.violations] == ["tool_without_method"]
    assert "Teleport" in spec.violations[0].message


def test_tool_without_docstring_sections(good_source: str) -> None:
    source = good_source.replace('        Example Output:\n            "-3"\n', "", 1)
    spec = analyze_source(source)
    assert [v.code for v in spec.violations] == ["tool_docstring_sections"]
    assert "GetElement" in spec.violations[0].message and "Example Output:" in spec.violations[0].message


def test_missing_done_and_methods(good_source: str) -> None:
    source = good_source.replace('"Done": self.DONE,', "").replace(
        "def get_ref_answer(self):", "def ref(self):"
    )
    assert sorted(_codes(source)) == ["missing_method", "missing_tool"]


@pytest.mark.parametrize(
    ("text", "env_class", "config"),
    [
        ('MaxEnv@{"a": [1, 2]}', "MaxEnv", {"a": [1, 2]}),
        ("MaxEnv@{'a': (1, 2), 'b': True}", "MaxEnv", {"a": (1, 2), "b": True}),
        ('MaxEnv@{"email": "x@y.z"}', "MaxEnv", {"email": "x@y.z"}),
    ],
)
def test_env_strings_parse(text: str, env_class: str, config: dict) -> None:
    parsed = parse_env_str(text)
    assert (parsed.env_class, parsed.config) == (env_class, config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("MaxEnv", "no '@'"),
        ("Max Env@{}", "not a Python identifier"),
        ("MaxEnv@[1, 2]", "must be an object"),
        ("MaxEnv@{oops", "neither JSON nor a Python literal"),
        ("MaxEnv@", "config is empty"),
    ],
)
def test_bad_env_strings_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(EnvStringError, match=message):
        parse_env_str(text)


def test_ability_strings_round_trip() -> None:
    for instance in training_instances():
        ability = parse_ability(instance["ability"])
        assert ability.code_id == instance["code_id"]
        assert ability.format() == instance["ability"]
        assert format_ability(ability.code_id, ability.env_class, ability.config) == instance["ability"]
    with pytest.raises(EnvStringError, match="prefix"):
        parse_ability('codegym_v2@A_1__XEnv@{"a": 1}')
    with pytest.raises(EnvStringError, match="code_id"):
        parse_ability('codegym_v1@XEnv@{"a": 1}')
    with pytest.raises(EnvStringError, match="no config"):
        parse_ability("codegym_v1@A_1__XEnv")


def test_answer_comparison_is_canonical_json() -> None:
    assert answers_equal([1, 2], (1, 2))
    assert answers_equal({"a": (1,)}, {"a": [1]})
    assert answers_equal(3, 3.0)
    assert not answers_equal(5, "5")
    assert answers_equal(5, "5", lenient=True)
    assert answers_equal("[1, 2]", [1, 2], lenient=True)
    assert not answers_equal(True, 1)
    assert not answers_equal([1, 2], [2, 1])
    assert answers_equal({3, 1, 2}, [1, 2, 3])
    assert canonical_json({"b": (1, 2.0), "a": None}) == '{"a":null,"b":[1,2]}'


def test_safety_scan_reports_risky_constructs() -> None:
    source = (
        "import os\nimport subprocess as sp\nfrom importlib import import_module\nimport json\n"
        "x = eval('1')\nexec('y = 2')\nf = open('/etc/passwd')\n"
        "c = ().__class__.__bases__[0].__subclasses__()\n__import__('socket')\nsuper().__init__()\n"
    )
    findings = {(f.kind, f.detail, f.line) for f in scan_source(source)}
    assert ("import", "os", 1) in findings
    assert ("import", "subprocess", 2) in findings
    assert ("import", "importlib", 3) in findings
    assert ("call", "eval()", 5) in findings
    assert ("call", "exec()", 6) in findings
    assert ("call", "open()", 7) in findings
    assert ("dunder_attribute", ".__subclasses__", 8) in findings
    assert ("call", "__import__()", 9) in findings
    assert not any(f[1] in ("json", ".__init__") for f in findings)


def test_sample_envs_are_clean_of_risky_constructs() -> None:
    for path in sample_env_paths():
        assert scan_source(path.read_text()) == [], path.name


def test_tool_json_output_is_stable() -> None:
    spec = parse_env_source((FIXTURE_ENVS / "Leetcode_34584_I__LexicographicalMaxEnv.py").read_text())
    names = [t["function"]["name"] for t in json.loads(json.dumps(tools_schema(spec)))]
    assert names == ["Observe", "CompareAndPop", "AppendChar", "TrimStack", "JoinStack", "Done"]
