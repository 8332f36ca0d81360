"""Text to ids and back: corpus files and batches (`corpus`), SentencePiece (`tokenizer`), the prepared
corpus in memory-mapped shards (`prepare`), the special ids (`vocab`), what `translate` reads (`inputs`)
and fetching Multi30k (`download`)."""
