"""The timings of a local federation that grow with its number of agents (``skyfed sim`` on one machine).

Every agent of a sim shares the machine's cores, so what a round costs grows with N while a deployment's
fixed defaults do not: at 300 agents on 2 cores the agents delivered about 5 updates a second, so a 60 s
deadline closed rounds on 193 of 300 updates and refused the rest as late, and 1,000 agents reporting every
2 s made the server check 500 signed statuses a second (docs/results/scale.md).
"""

from __future__ import annotations

from protocol.daemon import TICK_INTERVAL_S

STATUS_RATE_PER_S = 25.0  # the agents' heartbeats the server checks a second, at most, up to 500 agents
SERVER_STATUS_DELIVERIES_PER_S = 50.0  # the server's status as the agents receive it, in all, from 100 agents
DEADLINE_S = 60.0  # a round's deadline up to DEADLINE_AGENTS agents
DEADLINE_AGENTS = 120
ONNX_AGENTS = 50  # past this many agents, sim agents keep no on-board ONNX model
DEADLINE_S_PER_AGENT = 0.5  # past those: about twice what one agent's round cost on 2 cores at 300 agents
TICKS_PER_PROCESS_S = 100.0  # the idle loop turns a host process makes a second, at most


def status_interval_s(agents: int) -> float:
    """Each agent's heartbeat: every 2 s, slower past 50 agents so that the server checks at most
    ``STATUS_RATE_PER_S`` signed statuses a second up to 500 agents; never slower than a third of
    ``rounds.status_timeout_s`` (60 s): a status that late makes an agent ineligible."""
    return min(20.0, max(2.0, agents / STATUS_RATE_PER_S))


def server_status_interval_s(agents: int) -> float:
    """The server's status: every 2 s, slower past 100 agents so that the agents receive at most
    ``SERVER_STATUS_DELIVERIES_PER_S`` of them a second in all (every agent reads that topic: N deliveries a
    publish; at 1,000 agents every 2 s they were 20 a round per agent, and their reading a tenth of the hosts'
    CPU), never slower than 20 s. A round's start and close publish it at once whatever the interval."""
    return min(20.0, max(2.0, agents / SERVER_STATUS_DELIVERIES_PER_S))


def round_deadline_s(agents: int) -> float:
    """The round deadline when none is given: 60 s, and ``DEADLINE_S_PER_AGENT`` per agent past 120. Only an
    upper bound: a round closes as soon as every selected agent delivered."""
    return max(DEADLINE_S, DEADLINE_S_PER_AGENT * agents)


def agents_export_onnx(agents: int) -> bool:
    """Whether a sim's agents keep the on-board ONNX model (``training.onnx``). Each export costs about 0.7 s of
    CPU for the digits CNN: a device's own work, but 1,000 simulated devices' exports are 12 CPU-minutes a
    round on this 2-core machine, starving the daemons the run measures. Past ``ONNX_AGENTS`` they are off."""
    return agents <= ONNX_AGENTS


def hosted_tick_s(agents_in_process: int) -> float:
    """How often each of the agents one process hosts (``sim.agent_host``) turns its idle loop: every 0.1 s
    as deployed, slower past 10 agents so that the process makes at most ``TICKS_PER_PROCESS_S`` turns a second
    (100 agents each ticking every 0.1 s kept 1,000 agents' 10 processes busy on 2 cores while none trained).
    A message still wakes an agent at once."""
    return max(TICK_INTERVAL_S, agents_in_process / TICKS_PER_PROCESS_S)
