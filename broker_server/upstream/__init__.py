"""A region's aggregator under its root (``[upstream]``, docs/architecture.md "Regions"): the
hand-off between the two, and the regional rounds that follow the root's."""
