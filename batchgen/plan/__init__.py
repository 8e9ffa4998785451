"""Planning: prompts to checked token ids and hash chains, the radix tree, run order and partitions."""
