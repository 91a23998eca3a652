"""Performance benchmarks with their targets (``make bench``); each reports a ratio to a same-run baseline."""
