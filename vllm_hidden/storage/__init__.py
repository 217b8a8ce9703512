"""An extract output on disk or S3: the shard writer (shards, arena, commit), the journal and
manifest, the output as a whole with its parts and errors (output), S3 upload (s3), file
durability and hashing (files), and the checks of `inspect` (verify). No vLLM here."""
