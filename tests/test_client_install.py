"""A trainer installs the client alone and runs the docs' trainer example (docs/clients.md)
against `codegym up`.

`pip install ./clients` must bring one package, `codegym_client`, with grpcio and protobuf (and what
they need) and nothing else: no server package, no `codegym` command. The docs' example runs
there as written (only its address pointed at the test's runtime); its gymnasium example fails with
a message naming the `gym` extra, and runs once that extra is installed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SAMPLES
from tests.helpers.servers import CodegymServer

CLIENT = ROOT / "clients"
PACKAGE = CLIENT / "codegym_client"
CLIENT_DOCS = ROOT / "docs" / "clients.md"
DOCS_TARGET = "127.0.0.1:50051"
SERVER_PACKAGES = {"codegym", "codegym_jobs", "codegym_cli", "services", "sandbox_worker", "clients"}
# The adapters' modules and what they import beyond the client (an extra's, or the trainer's own).
ADAPTED = {
    "gym_env.py": {"gymnasium"},
    "verl/agent_loop.py": {"verl"},
    "verl/tool.py": {"verl"},
    "verl/advantage.py": {"verl", "torch", "numpy"},
    "verl/sampler.py": {"verl", "torch"},
}

# Replays a recorded episode with the drop-in client (observations compared with the recording),
# then reports the distributions and modules the venv has.
PLAY = """
import json, sys
from importlib import metadata
from codegym_client import OnlineGymEnv, RuntimeClient, SessionNotFound
from codegym_client.abilities import make_ability

trajectory = json.loads(sys.argv[2])
env = OnlineGymEnv.from_env_str(make_ability(trajectory["env_id"], trajectory["config"]), target=sys.argv[1])
seen = [env.step(action) for action, _ in trajectory["steps"]]
assert seen == [o for _, o in trajectory["steps"]], seen
assert env.finished and env.reward == 1.0
env.release()
with RuntimeClient(sys.argv[1]) as client:
    try:
        client.get_session("0" * 32)
    except SessionNotFound:
        pass
loaded = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps({"modules": loaded}))
"""

# What the client distribution brought: its files, what it requires (closed over the requirements
# of what it requires, extras aside), and every console script of the venv.
INVENTORY = """
import json, re
from importlib import metadata

def name(requirement):
    return re.split(r"[ ;<>=!~\\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")

needed, todo = set(), ["codegym-client"]
while todo:
    dist = todo.pop()
    if dist in needed:
        continue
    needed.add(dist)
    todo += [name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r]
print(json.dumps({
    "installed": sorted(d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()),
    "needed": sorted(needed),
    "files": sorted(str(f) for f in metadata.files("codegym-client")),
    "scripts": sorted(e.name for e in metadata.entry_points(group="console_scripts")),
}))
"""


def docs_examples() -> tuple[str, str]:
    """The trainer examples of docs/clients.md (python blocks using the client): the one without
    gymnasium, the one with it."""
    blocks = re.findall(r"```python\n(.*?)```", CLIENT_DOCS.read_text(), re.DOTALL)
    # The trainer examples use the runtime clients; the trainer integrations (TRL, verl) need their
    # trainers installed and have tests of their own.
    client = [
        b
        for b in blocks
        if "codegym_client" in b and "codegym_client.trl" not in b and "codegym_client.verl" not in b
    ]
    plain = [b for b in client if "RemoteEnv" not in b]
    gym = [b for b in client if "RemoteEnv" in b]
    assert len(plain) == 1 and len(gym) == 1, client
    assert DOCS_TARGET in plain[0] and DOCS_TARGET in gym[0]
    return plain[0], gym[0]


def run(argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    # Outside the checkout and without PYTHONPATH: only what the venv installed can be imported.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_the_client_package_imports_nothing_of_the_servers() -> None:
    """Every module of the package imports the standard library, grpc, protobuf or itself (and each
    adapter what it adapts, `ADAPTED`): the fence that keeps `pip install ./clients` a client."""
    allowed = set(sys.stdlib_module_names) | {"grpc", "google", "codegym_client"}
    for path in sorted(PACKAGE.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        extra = ADAPTED.get(path.relative_to(PACKAGE).as_posix(), set())
        assert names <= allowed | extra, (path, names - allowed - extra)


def oldest_python() -> str | None:
    """An interpreter of the oldest Python the client supports (clients/pyproject.toml), if this
    machine has one (pyenv's), else None."""
    root = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    found = sorted(root.glob(f"versions/{OLDEST}.*/bin/python"))
    return str(found[-1]) if found else shutil.which(f"python{OLDEST}")


OLDEST = "3.10"


@pytest.mark.slow
@pytest.mark.jail
@pytest.mark.parametrize("interpreter", ["this", OLDEST])
def test_the_client_alone_runs_the_readme_example(tmp_path: Path, interpreter: str) -> None:
    assert f'requires-python = ">={OLDEST}"' in (CLIENT / "pyproject.toml").read_text()
    base = sys.executable if interpreter == "this" else oldest_python()
    if base is None:
        pytest.skip(f"no Python {OLDEST} on this machine (the oldest the client supports)")
    plain_example, gym_example = docs_examples()
    # A copy of clients/ as a fresh clone has it: the build writes nothing into the checkout.
    source = tmp_path / "clients"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "trainer"
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    before = run([python, "-m", "pip", "list", "--format", "json"], tmp_path)
    baseline = {p["name"].lower() for p in json.loads(before.stdout)}

    install = run([*pip, str(source)], tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    inventory = run([python, "-c", INVENTORY], tmp_path)
    assert inventory.returncode == 0, inventory.stderr[-3000:]
    found = json.loads(inventory.stdout)
    # The client and what it needs (grpcio, protobuf and their own requirements), nothing more.
    assert set(found["installed"]) - baseline == set(found["needed"])
    assert {"codegym-client", "grpcio", "protobuf"} <= set(found["needed"])
    assert not set(found["needed"]) & {"codegym", "gymnasium", "openai", "rich", "redis", "grpcio-tools"}
    # One package: every file of the distribution is codegym_client's or its metadata's.
    tops = {f.split("/")[0] for f in found["files"]}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"codegym_client"}, tops
    assert "codegym_client/api/runtime/v1/runtime_service_pb2.pyi" in found["files"]
    assert "codegym_client/py.typed" in found["files"]
    # No server package and no command line anywhere in the venv.
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not {p.name for p in site.iterdir()} & SERVER_PACKAGES
    assert "codegym" not in found["scripts"] and not (venv / "bin" / "codegym").exists()

    trajectory = next(
        json.loads(x)
        for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()
        if '"Sample_0009' in x
    )
    up = CodegymServer(["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "1"])
    try:
        played = run([python, "-c", PLAY, up.address, json.dumps(trajectory)], tmp_path, 120)
        assert played.returncode == 0, played.stderr[-3000:]
        modules = set(json.loads(played.stdout.strip().splitlines()[-1])["modules"])
        assert {"codegym_client", "grpc"} <= modules
        assert not modules & (SERVER_PACKAGES | {"gymnasium", "openai", "grpc_health"})

        example = run([python, "-c", plain_example.replace(DOCS_TARGET, up.address)], tmp_path, 120)
        assert example.returncode == 0, example.stderr[-3000:]
        assert "GetElement" in example.stdout and "12 2" in example.stdout, example.stdout

        gym = gym_example.replace(DOCS_TARGET, up.address)
        without = run([python, "-c", gym], tmp_path, 120)
        assert without.returncode != 0 and "codegym-client[gym]" in without.stderr, without.stderr[-3000:]
        extra = run([*pip, f"{source}[gym]"], tmp_path)
        assert extra.returncode == 0, extra.stderr[-3000:]
        with_gym = run([python, "-c", gym], tmp_path, 120)
        assert with_gym.returncode == 0, with_gym.stderr[-3000:]
        assert "Result: Correct, reward=1 1.0 True False" in with_gym.stdout, with_gym.stdout
    finally:
        assert up.stop() == 0
