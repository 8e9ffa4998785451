"""Job input and output: read prompt tables into rows, the output table, resumable Parquet shards."""
