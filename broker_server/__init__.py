"""The aggregator daemon: agent registry, round engine, strategies, checkpoints, monitor."""
