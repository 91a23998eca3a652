"""What ``skyfed server run`` builds for a ``server.toml`` with ``[upstream]`` (``broker_server.cli`` asks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker_server.config import ServerConfig
    from region.daemon import Region


def build_region(config: ServerConfig) -> Region:
    from region.daemon import Region  # PyTorch: seconds, so only once the config is known good

    return Region(config)
