"""Peer mode (SmartFed's decentralized federation, docs/architecture.md "Peer mode"): no server; every peer
trains, seals its update to every other member, checks and aggregates theirs, and elects the best model."""
