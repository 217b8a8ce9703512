"""The shard format, in one place: what a writer writes and every reader reads.

- `header`: the safetensors container: dtype names and the header (parse, build), for files
  and for in-memory buffers (the server's responses);
- `shard`: the shard schema on top of it: the format tag, tensor names, the per-sample
  index and checksums, file names and the shard record (`ShardInfo`);
- `quant`: a stored row's values and its per-row statistic (amax, or the fp8 scale);
- `stats`: the per-layer statistics of the stored states, per shard and summed over shards,
  and what `inspect` flags in them.

Pure: torch, json and blake3 only; nothing here does I/O beyond the `read` callables it is
handed, so the writer, the reader, S3, `inspect` and the server share it.
"""
