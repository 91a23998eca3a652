"""The server's agents: who they are (registry, enrolled folder, group key), what it sends them
(models, round tasks, re-sends), how their complete updates come into the round (``intake``), what it
refuses or ignores of them, and how it answers changes in the fleet that it did not make."""
