"""Local federations for the demo and experiments: broker start-up, federation layout, runs, plots."""
