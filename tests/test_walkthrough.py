"""docs/deploy.md's step-by-step deployment, run exactly as written: keys, enrolment, data, configs, a
plain-MQTT broker, the server, three agents and a watcher on the metrics topic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from sim.broker import free_port

DEPLOY_DOC = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"


def walkthrough() -> str:
    text = DEPLOY_DOC.read_text()
    section = text.split("<!-- walkthrough")[1].split("<!-- /walkthrough -->")[0]
    return section.split("```bash\n", 1)[1].rsplit("```", 1)[0]


def test_the_readme_walkthrough_runs_as_written(tmp_path):
    env = {**os.environ, "PORT": str(free_port()), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    process = subprocess.Popen(
        ["bash", "-c", walkthrough()], cwd=tmp_path, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever a failed run left behind
        except ProcessLookupError:
            pass
    fleet = tmp_path / "fleet"
    assert (fleet / "rounds.jsonl").exists(), output[-3000:]
    rounds = [json.loads(line) for line in (fleet / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3], output[-3000:]
    assert all(r["outcome"] == "committed" and len(r["accepted"]) == 3 for r in rounds)
    assert rounds[-1]["eval"]["accuracy"] > 0.5
    assert (fleet / "server" / "state" / "global_model.safetensors").exists()
