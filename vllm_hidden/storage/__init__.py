"""Shards, manifest and (later) uploaders. No vLLM here."""
