"""The wire contract shared by agents and the aggregator: topics, message schemas, chunked transfers, MQTT."""
