"""A tiny model made offline for tests and demos (nothing is downloaded)."""
