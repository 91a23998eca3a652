"""The lowest layer: durable files, parsing of untrusted JSON, sd_notify. Imports nothing else of SkyFed."""
