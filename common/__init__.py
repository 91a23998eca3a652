"""The lowest layer: durable files and parsing of untrusted JSON. Imports nothing else of SkyFed."""
