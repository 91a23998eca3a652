"""The federated-learning core that both daemons and a peer share: an update's format (encoding beside
decoding), its checks and influence bounds, the strategies, the best-model election and the round rules
(docs/architecture.md, "Layers")."""
