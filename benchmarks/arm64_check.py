"""The edge agent on an arm64 Debian userland, under QEMU user-mode emulation, against an x86 server.

What a Raspberry Pi (64-bit Raspberry Pi OS Bookworm is Debian 12) gets, run on this machine: debootstrap
builds an arm64 Debian 12 root, ``deploy/install-agent.sh --torch cpu`` installs the agent into it as on a
device (inside the root, so the venv is arm64), and the installed agent, with the config and keys
``skyfed provision`` wrote for it, completes rounds against this machine's server over a mosquitto run from
the provisioned TLS config. It times each step and writes ``arm64-check.json`` in the work folder;
docs/results/edge_agent.md has its figures. Too slow for CI (emulation): run by hand, as root:

    apt-get install debootstrap qemu-user-static binfmt-support mosquitto
    sudo .venv/bin/python -m benchmarks.arm64_check [--work /var/tmp/skyfed-arm64] [--rounds 2]

The root is kept in ``--work`` and reused (delete it to start over). PyPI's torch 2.14.1 for aarch64 is a
CUDA build that pulls the CUDA 13 toolkit (gigabytes a Pi cannot use); without the PyTorch CPU index
(unreachable here), the check pins PyPI's 2.9.1 aarch64 CPU build instead (``--torch-pin``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from protocol.config import read_toml, write_toml
from sim.broker import free_port, start_broker
from sim.classify_layout import write_classify_data
from sim.launch import terminate

CHECKOUT = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = "python3,python3-venv,python3-pip,ca-certificates,passwd,procps"
AGENT = "pi-01"
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def say(text: str) -> None:
    print(f"arm64-check: {text}", flush=True)


def timed(what: str, argv: list[str], **kwargs) -> float:  # noqa: ANN003
    """Run ``argv`` (its output to ours), fail on a non-zero exit, return the seconds it took."""
    say(f"{what}: {' '.join(argv)}")
    started = time.monotonic()
    subprocess.run(argv, check=True, **kwargs)
    seconds = time.monotonic() - started
    say(f"{what}: {seconds:.0f} s")
    return seconds


def check_host() -> None:
    """Root, the tools, and binfmt_misc handing aarch64 binaries to QEMU (mounted and enabled if it is not)."""
    if os.geteuid() != 0:
        sys.exit("arm64-check: run as root (debootstrap, chroot and the installer need it)")
    for tool in ("debootstrap", "mosquitto", "chroot"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"arm64-check: {tool} not found: apt-get install debootstrap qemu-user-static binfmt-support "
                     "mosquitto")  # fmt: skip
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=True)
    if not (BINFMT / "qemu-aarch64").exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], check=False)
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists() or not entry.read_text().startswith("enabled"):
        sys.exit("arm64-check: binfmt_misc has no enabled qemu-aarch64 entry: apt-get install qemu-user-static "
                 "binfmt-support")  # fmt: skip


def bootstrap(root: Path) -> float:
    if (root / "etc" / "debian_version").exists():
        say(f"{root}: an arm64 Debian root from an earlier run, reused")
        return 0.0
    return timed("debootstrap", ["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={PACKAGES}",
                                 SUITE, str(root), MIRROR])  # fmt: skip


def mount_system(root: Path, stack: ExitStack) -> None:
    """/proc, /sys and /dev inside the root (pip, PyTorch and the agent need them), unmounted at the end."""
    for name in ("proc", "sys", "dev"):
        target = root / name
        if os.path.ismount(target):  # left by a run that was killed
            subprocess.run(["umount", "--recursive", "--lazy", str(target)], check=True)
        subprocess.run(["mount", "--rbind", f"/{name}", str(target)], check=True)
        stack.callback(subprocess.run, ["umount", "--recursive", "--lazy", str(target)], check=False)
    shutil.copyfile("/etc/resolv.conf", root / "etc" / "resolv.conf")
    for name in ("etc/pip.conf", "etc/ssl/certs/ca-certificates.crt"):  # how this host reaches PyPI (a proxy's CA)
        if Path("/", name).exists():
            shutil.copyfile(Path("/", name), root / name)


def copy_source(root: Path) -> Path:
    """The checkout at /opt/skyfed-src in the root, less its venv and history (the installer stages the rest)."""
    target = root / "opt" / "skyfed-src"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(CHECKOUT, target, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__"))
    return target


def pinned_constraints(source: Path, torch_pin: str) -> Path:
    """constraints.txt with torch and torchvision at ``torch_pin`` (``TORCH,TORCHVISION``)."""
    torch, vision = torch_pin.split(",")
    text = (source / "constraints.txt").read_text()
    text = re.sub(r"(?m)^torch==\S+", f"torch=={torch}", text)
    text = re.sub(r"(?m)^torchvision==\S+", f"torchvision=={vision}", text)
    out = source / "constraints-arm64-check.txt"
    out.write_text(text)
    return out


def provision(work: Path, port: int, rounds: int) -> tuple[Path, Path]:
    """``skyfed provision`` for one agent; the server's config pointed at this work folder (state, evaluation
    set) and at short rounds with a deadline an emulated device can meet. Returns (fleet folder, data folder)."""
    fed, data = work / "fed", work / "data"
    for old in (fed, work / "server-state"):  # a new federation each run: an old run id would be resumed
        shutil.rmtree(old, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "skyfed", "provision", "--federation", "arm", "--agents", AGENT, "--out",
                    str(fed), "--broker", f"127.0.0.1:{port}", "--listen", "127.0.0.1"], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    write_classify_data(data, [AGENT], "iid", seed=0)
    server_toml = fed / "server" / "server.toml"
    config = read_toml(server_toml)
    config["server"] |= {"state_dir": str(work / "server-state"), "eval_data": str(data / "server" / "test.npz"),
                         "rounds": rounds}  # fmt: skip
    config["rounds"] = {"min_agents": 1, "quorum": 1, "deadline_s": 3600.0, "status_timeout_s": 600.0}
    config["training"] = {"epochs": 1}
    config["strategy"] = {"name": "fedavg"}
    write_toml(server_toml, config)
    return fed, data


def installed_skyfed(root: Path) -> str:
    """The ``skyfed`` the installed unit runs (its ExecStart), as a path inside the root."""
    unit = (root / "etc" / "systemd" / "system" / "skyfed-agent.service").read_text()
    return re.search(r"(?m)^ExecStart=(\S+)", unit).group(1)


def in_root(root: Path, *argv: str, user: str | None = None) -> list[str]:
    """``argv`` run inside ``root`` with a clean environment, as root or as ``user`` (the service's user)."""
    spec, home = ([f"--userspec={user}:{user}"], "/var/lib/skyfed") if user else ([], "/root")
    return ["chroot", *spec, str(root), "/usr/bin/env", "-i", f"HOME={home}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG=C.UTF-8", *argv]  # fmt: skip


def wait_for_rounds(metrics: Path, server: subprocess.Popen, agent: subprocess.Popen, rounds: int, limit_s: float
                    ) -> list[dict]:  # fmt: skip
    """The server's metrics rows once ``rounds`` are in, either daemon exited, or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while True:
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if len(rows) >= rounds or server.poll() is not None or agent.poll() is not None or time.monotonic() > deadline:
            return rows
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/skyfed-arm64"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-pin", default="2.9.1,0.24.1", metavar="TORCH,TORCHVISION",
                        help="torch and torchvision releases for the arm64 venv (default: PyPI's aarch64 CPU build)")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="how long the rounds may take in all")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: mounts, broker, daemons
    check_host()
    work, figures = args.work.resolve(), {}
    root = work / "root"
    work.mkdir(parents=True, exist_ok=True)
    figures["debootstrap_s"] = round(bootstrap(root), 1)
    with ExitStack() as stack:
        mount_system(root, stack)
        source = copy_source(root)
        constraints = pinned_constraints(source, args.torch_pin)
        port = free_port()
        fed, data = provision(work, port, args.rounds)
        prov = root / "root" / "prov"
        shutil.rmtree(prov, ignore_errors=True)
        shutil.copytree(fed / "agents" / AGENT, prov / AGENT)
        figures["install_s"] = round(timed("install", in_root(
            root, "bash", "/opt/skyfed-src/deploy/install-agent.sh", "--torch", "cpu", "--torch-index", "none",
            "--constraints", f"/{constraints.relative_to(root)}", "--no-start", "--force-config",
            f"/root/prov/{AGENT}")), 1)  # this run's provisioning, whatever an earlier run installed
        state = root / "var" / "lib" / "skyfed" / AGENT
        for old in state.iterdir():  # an earlier run's progress belongs to an earlier federation
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        shutil.copyfile(data / AGENT / "data.npz", state / "data.npz")
        shutil.chown(state / "data.npz", *(state.stat().st_uid, state.stat().st_gid))
        figures["machine"] = subprocess.run(in_root(root, "uname", "-m"), capture_output=True, text=True).stdout.strip()
        skyfed = installed_skyfed(root)
        figures["import_s"] = round(timed("import", in_root(
            root, str(Path(skyfed).with_name("python")), "-c",
            "import torch, agent.daemon; print('torch', torch.__version__)",
            user="skyfed")), 1)  # fmt: skip
        broker = start_broker(data_dir=work / "broker", kind="mosquitto", port=port,
                              config_file=fed / "broker" / "skyfed.conf")  # fmt: skip
        stack.callback(broker.stop)
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        server = subprocess.Popen([sys.executable, "-m", "skyfed", "server", "run", "--config",
                                   str(fed / "server" / "server.toml")], stdout=(logs / "server.log").open("wb"),
                                  stderr=subprocess.STDOUT)  # fmt: skip
        stack.callback(terminate, [server], 30.0)
        started = time.monotonic()
        agent = subprocess.Popen(in_root(root, skyfed, "agent", "run", "--config",
                                         "/etc/skyfed/agent.toml", user="skyfed"),
                                 stdout=(logs / "agent.log").open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        stack.callback(terminate, [agent], 60.0)  # a clean stop, as systemd gives it
        rows = wait_for_rounds(work / "server-state" / "metrics.jsonl", server, agent, args.rounds, args.limit_s)
        figures["launch_to_last_round_s"] = round(time.monotonic() - started, 1)
    figures["rounds"] = [{"round": r["round"], "outcome": r["outcome"], "duration_s": round(r["duration_s"], 1),
                          "accepted": r["accepted"], "accuracy": r.get("eval", {}).get("accuracy")}
                         for r in rows]  # fmt: skip
    (work / "arm64-check.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    committed = [r for r in rows if r["outcome"] == "committed" and AGENT in r["accepted"]]
    if len(committed) < args.rounds:
        sys.exit(f"arm64-check: {len(committed)} of {args.rounds} rounds committed with {AGENT}; logs in {logs}")
    say(f"passed: {len(committed)} rounds with the arm64 agent (logs in {logs})")


if __name__ == "__main__":
    main()
