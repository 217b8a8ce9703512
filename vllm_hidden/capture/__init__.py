"""Per-step capture: one device buffer, one D2H copy into a host ring, per-sample assembly;
finished samples go to shards (vllm_hidden.storage) or, when served, over the result
channel to the API server (channel)."""
