"""Keys, enrolment, sealed envelopes, signed documents and replay protection (standard constructions only)."""
