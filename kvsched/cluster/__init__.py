"""Several daemons as one control plane, coordinated through NATS with JetStream.

Nothing here is home-made coordination: membership and instance leases are JetStream key-value
buckets (compare-and-set on an entry's revision), KV events and the request journal are
JetStream streams. See docs/ARCHITECTURE.md ("The cluster") for who owns which bucket and
stream. A daemon started without `cluster` imports nothing from this package.
"""
