"""A decode pool member: reserves blocks, receives KV, decodes, streams tokens."""
