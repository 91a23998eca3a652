"""Models, weights as named arrays, safe serialization, datasets and partitioners (no I/O on the network)."""
