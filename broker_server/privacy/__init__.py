"""Central differential privacy at the aggregator: the policy and its config check, the Gaussian
mechanism and the noise step, adaptive clipping, and the per-agent (ε, δ) ledger."""
