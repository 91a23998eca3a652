"""The server's shared data pool (``[pool]``, seed 002's hybrid data sharing): its data trained as one
more participant, ``server-pool``, every round, and the running server's side that starts it and
accepts its update like an agent's."""
