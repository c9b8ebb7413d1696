"""Durability: the journal of accepted requests in NATS JetStream (records.py: subjects and
record encoding; journal.py: writing, flushing, recovering, looking up)."""
