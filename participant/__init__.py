"""The participant's half of federated learning, usable by the edge agent, a peer and the server's
shared-pool trainer: trainers (PyTorch classifiers, Ultralytics detectors), local DP-SGD, momentum and
mixed-precision state kept across rounds (docs/architecture.md, "Layers")."""
