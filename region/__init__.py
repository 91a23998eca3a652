"""A region's aggregator under a root (``[upstream]`` in server.toml): the aggregator daemon for the region's
agents and, beside it, one participant in the root's federation (docs/architecture.md, "Regions")."""
