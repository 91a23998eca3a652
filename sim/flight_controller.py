"""An emulated flight controller on a pseudo-terminal, speaking real MAVLink 2 (pymavlink's encoder).

For tests and demos of the agent's telemetry gate without a drone: the pty's slave path (``device``)
is what the agent opens with pyserial, exactly like ``/dev/ttyACM0``. Several times a second it sends
HEARTBEAT (armed flag from ``arm()`` / ``disarm()``), SYS_STATUS and BATTERY_STATUS (``set_battery``).
``pause()`` makes it go silent with the port still there; ``stop()`` makes the device vanish.

    python -m sim.flight_controller        # prints the device path, then reads commands from stdin
"""

from __future__ import annotations

import argparse
import os
import threading
import tty

from pymavlink.dialects.v20 import common as mavlink

CELLS = 4
NO_CELL = 65535  # BATTERY_STATUS: voltages[] entries without a cell


def open_pty() -> tuple[int, int, str]:
    """``(master fd, slave fd, slave path)`` of a new pty in raw mode (no echo, no line editing, no
    XON/XOFF: binary bytes pass untouched even before the reader configures it). Writes to the master
    never block: like a UART, a full buffer drops bytes instead of stalling the writer."""
    master, slave = os.openpty()
    tty.setraw(slave)
    os.set_blocking(master, False)
    return master, slave, os.ttyname(slave)


class FlightController:
    """Start with ``start()`` or ``with``; thread-safe setters; ``device`` is the path to open."""

    def __init__(self, *, rate_hz: float = 5.0, battery_pct: int = 80, charging: bool = False, system: int = 1) -> None:
        self.rate_hz = rate_hz
        self.armed = False
        self.battery_pct = battery_pct
        self.charging = charging
        self.paused = False
        self._mav = mavlink.MAVLink(None, srcSystem=system, srcComponent=mavlink.MAV_COMP_ID_AUTOPILOT1)
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: tuple[int, int] | None = None
        self.device = ""

    def start(self) -> FlightController:
        master, slave, self.device = open_pty()
        self._fds = (master, slave)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flight-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sending and close the pty: to the reader, the device is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._write_lock:
            if self._fds is not None:
                for fd in self._fds:
                    os.close(fd)
                self._fds = None

    def __enter__(self) -> FlightController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def set_battery(self, pct: int, *, charging: bool | None = None) -> None:
        self.battery_pct = pct
        if charging is not None:
            self.charging = charging

    def pause(self) -> None:
        """Go silent (a hung autopilot, a cut wire) while the port stays open."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def send_raw(self, data: bytes) -> None:
        """Put arbitrary bytes on the line: another sender's frames, or noise."""
        with self._write_lock:
            if self._fds is not None:
                try:
                    os.write(self._fds[0], data)
                except BlockingIOError:  # nobody reads: drop, as a UART would
                    pass

    def frames(self) -> bytes:
        """One round of telemetry as the autopilot would send it."""
        mav, pct = self._mav, self.battery_pct
        armed = mavlink.MAV_MODE_FLAG_SAFETY_ARMED if self.armed else 0
        base_mode = mavlink.MAV_MODE_FLAG_CUSTOM_MODE_ENABLED | armed
        state = mavlink.MAV_STATE_ACTIVE if self.armed else mavlink.MAV_STATE_STANDBY
        millivolts = int(3300 + 9 * pct)  # per cell, 3.3 V empty to 4.2 V full
        charge = mavlink.MAV_BATTERY_CHARGE_STATE_CHARGING if self.charging else mavlink.MAV_BATTERY_CHARGE_STATE_OK
        messages = [
            mav.heartbeat_encode(mavlink.MAV_TYPE_QUADROTOR, mavlink.MAV_AUTOPILOT_ARDUPILOTMEGA, base_mode, 0, state),
            mav.sys_status_encode(0, 0, 0, 0, millivolts * CELLS, -1, pct, 0, 0, 0, 0, 0, 0),
            mav.battery_status_encode(
                0,
                mavlink.MAV_BATTERY_FUNCTION_ALL,
                mavlink.MAV_BATTERY_TYPE_LIPO,
                32767,  # INT16_MAX: temperature unknown
                [millivolts] * CELLS + [NO_CELL] * (10 - CELLS),
                -1,
                -1,
                -1,
                pct,
                charge_state=charge,
            ),
        ]
        return b"".join(bytes(m.pack(mav)) for m in messages)

    def _run(self) -> None:
        while not self._stop.wait(1 / self.rate_hz):
            if not self.paused:
                self.send_raw(self.frames())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.0, help="telemetry rounds per second")
    parser.add_argument("--battery", type=int, default=80, help="battery percent")
    args = parser.parse_args()
    with FlightController(rate_hz=args.rate, battery_pct=args.battery) as fc:
        print(f"flight controller on {fc.device} (MAVLink 2, system 1); point telemetry.mavlink at it", flush=True)
        print("commands: arm | disarm | battery PCT | charging on|off | pause | resume | quit", flush=True)
        actions = {"arm": fc.arm, "disarm": fc.disarm, "pause": fc.pause, "resume": fc.resume}
        try:
            for line in iter(input, "quit"):
                words = line.split()
                if len(words) == 1 and words[0] in actions:
                    actions[words[0]]()
                elif len(words) == 2 and words[0] == "battery" and words[1].isdigit():
                    fc.set_battery(min(100, int(words[1])))
                elif len(words) == 2 and words[0] == "charging" and words[1] in ("on", "off"):
                    fc.charging = words[1] == "on"
                elif words:
                    print("? arm | disarm | battery PCT | charging on|off | pause | resume | quit", flush=True)
        except (EOFError, KeyboardInterrupt):
            pass


if __name__ == "__main__":
    main()
