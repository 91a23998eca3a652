"""Untrusted text in logs and metrics: one line, bounded."""

from common.text import printable


def test_control_characters_are_escaped_and_length_is_bounded():
    forged = "none\nINFO skyfed.server: round closed round=8 outcome=committed\x1b[2J"
    shown = printable(forged)
    assert "\n" not in shown and "\x1b" not in shown and "\\n" in shown and "\\x1b" in shown
    assert printable("x" * 1000, limit=50) == "x" * 50
    assert printable("drone-01 ok") == "drone-01 ok"
