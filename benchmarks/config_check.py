"""``skyfed server check`` and ``skyfed agent check`` wall time, as an operator runs them: a fresh interpreter per
check (the command's own start-up included), on a provisioned federation's configs.

Target: <= 0.5 s each (median of 5 after a warm-up that leaves the bytecode cache written, as an installed
package has it). Beside it, the same interpreter doing nothing (``python -c pass``): the floor no command
goes under. Where the time goes: ``python -X importtime -m skyfed server check --config …``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import median_seconds, report
from sim.broker import free_port
from sim.federation import SimSettings, create_federation

LIMIT_S = 0.5


def run(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, *args], check=True, env=env, stdout=subprocess.DEVNULL)


def main(repeats: int = 5) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="skyfed-check-") as folder:
        layout = create_federation(Path(folder), SimSettings(agents=1, rounds=1, federation="bench"),
                                   ("127.0.0.1", free_port()))  # fmt: skip
        server = median_seconds(lambda: run("-m", "skyfed", "server", "check", "--config",
                                            str(layout.server_config)), repeats)  # fmt: skip
        agent = median_seconds(lambda: run("-m", "skyfed", "agent", "check", "--config",
                                           str(layout.agent_configs["agent-01"])), repeats)  # fmt: skip
    bare = median_seconds(lambda: run("-c", "pass"), repeats)
    return [report("config_check", target=f"<= {LIMIT_S} s each", ok=max(server, agent) <= LIMIT_S,
                   server_check_s=round(server, 3), agent_check_s=round(agent, 3),
                   bare_interpreter_s=round(bare, 3))]  # fmt: skip


if __name__ == "__main__":
    main()
