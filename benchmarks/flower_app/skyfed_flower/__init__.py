"""SkyFed's digits CNN federated by Flower (benchmarks.flower): the ServerApp runs Flower's FedAvg, each ClientApp
trains with SkyFed's own loop, seed and data files, so accuracy per round matches SkyFed's and only time differs."""
