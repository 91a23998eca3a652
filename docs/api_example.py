"""SkyFed's Python API in one script (docs/api.md): a whole local federation in one call, then the same
federation by hand (configs, a broker, a server and two agents on threads of this process), then its metrics.

    python docs/api_example.py [OUT]        # OUT: where the runs' files go (default: a temporary folder)

Two agents, one round on the digits data: seconds on a laptop CPU. Needs mosquitto (apt-get install mosquitto)
or the pip-installed iotcore broker. tests/test_api.py runs this script, so it stays true.
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from skyfed import api


def main(out: Path, broker: str | None = None) -> list[api.RoundMetrics]:
    """Both ways; ``broker``: a running broker's HOST:PORT to use instead of starting one."""
    # 1. One call, like Flower's fl.simulation.start_simulation: broker, server and agents started and stopped.
    result = api.run_federation(agents=2, rounds=1, epochs=1, out=out / "sim", broker=broker)
    print(f"run_federation: {len(result.metrics)} round(s) in {result.seconds:.1f} s, final model {result.final_eval}")

    # 2. By hand, like fl.server.start_server and fl.client.start_client: the daemons on their config files.
    with ExitStack() as stack:
        address = broker or stack.enter_context(api.local_broker(out / "broker"))
        layout = api.write_federation(out / "federation", address, agents=2, rounds=1, epochs=1, federation="by-hand")
        for config in layout.agent_configs.values():  # agent.toml: keys, data, broker; they run until stopped
            stack.enter_context(api.Agent(config))
        with api.Server(layout.server_config) as server:  # server.toml: rounds, strategy, model
            if not server.wait(timeout_s=300):
                raise RuntimeError("the federation did not finish in 5 minutes")

    # 3. The metrics: one RoundMetrics per finished round (the server's state_dir/metrics.jsonl).
    metrics = api.read_metrics(server.state_dir)
    for m in metrics:
        print(f"round {m.round}: {m.outcome}, accuracy {m.eval.get('accuracy')}, "
              f"updates accepted {len(m.accepted)}/{len(m.participants)} rejected {len(m.rejected)}")
    return metrics


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(scratch))
