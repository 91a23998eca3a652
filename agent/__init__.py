"""The edge daemon: config, round state machine, local trainers, durable progress."""
