"""``make bench``: run every benchmark and print one JSON line per result (for docs/results/benchmarks.md)."""

from benchmarks import agent_memory, aggregation, config_check, flower, kept_models, scale, swapping, transport


def main() -> None:
    aggregation.main()
    config_check.main()
    transport.main()
    swapping.main()
    kept_models.main()
    agent_memory.main()
    scale.overhead_at_100()
    flower.main()


if __name__ == "__main__":
    main()
