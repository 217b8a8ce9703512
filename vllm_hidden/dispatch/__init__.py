"""Prompts -> engines: one engine in this process, or several (data parallel) fed from one
shared input, as local processes or Ray actors."""
