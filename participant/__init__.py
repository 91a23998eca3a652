"""The participant's half of federated learning, usable by the edge agent, a peer and the server's
shared-pool trainer: trainers (PyTorch classifiers, Ultralytics detectors), local DP-SGD, momentum and
mixed-precision state kept across rounds, training jobs and runners, and ``RoundClient`` (a round's
train, encode, store, seal-and-send and durable progress) (docs/architecture.md, "Layers")."""
