"""The daemon's configuration: `kvsched serve`'s arguments, the typed config, and how file, environment and flags merge into it."""
