"""The server's shared data pool (``[pool]``, seed 002's hybrid data sharing): its data trained as one
more participant, ``server-pool``, every round, and the running server's side that starts it and
accepts its update like an agent's."""

POOL = "server-pool"  # the shared pool's participant name: in a round's selected, accepted and metrics
POOL_NAME_TAKEN = f"{POOL!r} is the shared pool's name: enrol the agent under another id or remove [pool]"
