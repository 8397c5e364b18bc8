"""The scheduling core, free of torch and sockets: sequences, the paged KV block allocator with chained prefix
keys, the embedding-cache index, and ``SchedulerCore`` which admits, chunks and plans each step. The scheduler
process drives it; the offline engine too."""
