"""The operator's provisioning: key, certificate and config folders for every node, the broker's config and ACL,
a region's bridge, and the ``skyfed keys|certs|provision`` commands that write them (docs/architecture.md
"Layout"). It builds on ``security/`` (keys, PKI) and ``protocol/`` (config files); no daemon imports it."""
