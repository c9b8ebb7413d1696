"""The instances the daemon schedules: one engine loop per instance, its worker ranks, the registry that owns the engines and routes among them, models and limits."""
