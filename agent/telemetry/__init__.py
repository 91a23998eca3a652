"""Telemetry gating: train only when the device's state allows it (docs/architecture.md, "Round lifecycle" step 2).

Sources: a flight controller over MAVLink (armed, battery, charging), a line-based power board on a serial
port, Linux thermal zones, and in a sim an availability trace in place of the flights. ``gate_reasons`` turns
their readings and the ``[gate]`` policy into the reasons published in the agent's status (``gate.reasons``);
the server selects only agents whose gate is open. This package must stay light (no torch, no numpy) and must
never write to the flight controller.
"""

from agent.telemetry.config import GatePolicy, TelemetrySection, check_availability, check_gate_sources
from agent.telemetry.gate import gate_reasons
from agent.telemetry.monitor import Telemetry
from agent.telemetry.readings import Readings, SourceReading

__all__ = [
    "GatePolicy",
    "Readings",
    "SourceReading",
    "Telemetry",
    "TelemetrySection",
    "check_availability",
    "check_gate_sources",
    "gate_reasons",
]
