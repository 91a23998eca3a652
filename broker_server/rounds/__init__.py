"""The round engine and its collaborators: a round from start to commit, the close-of-round
pipeline and its steps, acceptance of updates, and the state that survives a restart (checkpoint,
update store, metrics log). No MQTT: the daemon turns the engine's results into messages."""
