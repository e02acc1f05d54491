"""Operations: dead letters, the concurrency verification, changing the shard count."""
