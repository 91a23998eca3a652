"""``skyfed dashboard``: a static page that watches a federation live over MQTT-over-WebSockets (docs/dashboard.md)."""
