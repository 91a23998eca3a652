"""What ``skyfed provision`` tells the operator: the steps new agents need, missing evaluation data, a checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

from skyfed import main

ROOT = Path(__file__).resolve().parent.parent


def _provision(out: Path, agents: str) -> int:
    return main(["provision", "--federation", "fleet", "--agents", agents, "--out", str(out), "--broker",
                 "127.0.0.1:8883", "--state-dir", str(out.parent / "state"), "--any-state-dir"])  # fmt: skip


def test_adding_an_agent_says_to_reload_the_broker_and_enrol_its_key(tmp_path, capsys):
    out = tmp_path / "pki"
    assert _provision(out, "a1") == 0
    capsys.readouterr()
    assert _provision(out, "a1,a2") == 0
    printed = capsys.readouterr()
    steps = printed.out[printed.out.index("next steps for a2") :]
    assert "systemctl reload mosquitto" in steps
    assert f"skyfed keys enroll {out}/server/enrolled/a2.pub --enrolled /etc/skyfed/enrolled" in steps
    assert "skyfed agent check --config /etc/skyfed/agent.toml" in steps and "a1" not in steps
    assert "server.toml has no server.eval_data" in printed.err


def test_defaults_that_name_this_machine_are_said_once_at_the_first_provision(tmp_path, capsys):
    """Found by the operator review: without --broker and --broker-dir the configs name broker.local and a
    path on the provisioning machine, and nothing said so."""
    out = tmp_path / "pki"
    assert main(["provision", "--federation", "fleet", "--agents", "a1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "every node will connect to broker.local:8883, the default --broker" in err
    assert f"mosquitto's skyfed.conf names {out.absolute()}/broker (the default --broker-dir" in err
    assert main(["provision", "--federation", "fleet", "--agents", "a1,a2", "--out", str(out)]) == 0
    assert "the default --broker" not in capsys.readouterr().err  # said once, when the choice was made
    assert _provision(tmp_path / "other", "a1") == 0 and "the default --broker," not in capsys.readouterr().err


def test_a_provisioning_folder_inside_a_git_checkout_is_warned_about_and_ignored_here(tmp_path, capsys):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert _provision(tmp_path / "sub" / "pki", "a1") == 0
    err = capsys.readouterr().err
    assert f"is inside the git work tree {tmp_path}" in err and "ca.crt.key" in err
    assert _provision(tmp_path.parent / f"{tmp_path.name}-outside", "a1") == 0
    assert "git work tree" not in capsys.readouterr().err
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "fleet/ca/ca.crt.key", "fleet-pki/ca/ca.crt.key"],
                             capture_output=True, text=True)  # fmt: skip
    assert ignored.stdout.split() == ["fleet/ca/ca.crt.key", "fleet-pki/ca/ca.crt.key"]


def test_the_enrol_step_it_prints_for_several_agents_runs_as_printed(tmp_path, capsys):
    out = tmp_path / "pki"
    assert _provision(out, "a1,a2") == 0
    printed = capsys.readouterr().out
    step = next(line for line in printed.splitlines() if "skyfed keys enroll" in line)
    command = step[step.index("skyfed keys enroll") :].removesuffix(" (no restart needed)").split()
    enrolled = tmp_path / "enrolled"
    command[command.index("--enrolled") + 1] = str(enrolled)  # the server host's /etc/skyfed/enrolled
    assert main(command[1:]) == 0
    assert sorted(p.name for p in enrolled.glob("*.pub")) == ["a1.pub", "a2.pub"]
    assert "next steps for a1, a2 (a broker and server installed from this folder's broker/ and server/ have " \
           "them already: start at step 3):" in printed  # a first provision: steps 1 and 2 are for later additions
    numbers = [line.split(".")[0].strip() for line in printed.splitlines() if line.startswith("  ")]
    assert len(numbers) == len(set(numbers)), printed  # each step its own number


def test_an_agent_added_after_every_earlier_one_was_revoked_still_gets_the_reload_and_enrol_steps(tmp_path, capsys):
    """The installed broker and server predate it: only a folder provisioned just now has it in them already."""
    out = tmp_path / "pki"
    assert _provision(out, "a1,a2") == 0
    for agent in ("a1", "a2"):
        assert main(["provision", "revoke", agent, "--out", str(out)]) == 0
    capsys.readouterr()
    assert _provision(out, "a3") == 0
    printed = capsys.readouterr().out
    assert "next steps for a3 (until then the broker drops what they publish" in printed
    assert "provisioned 1 agents in" in printed and "(1 new: a3; 2 revoked)" in printed
