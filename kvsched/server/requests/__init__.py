"""A request's way through the daemon: RequestService, acceptance, the request table and its records, token delivery to the streams, the journal glue, Resume, timers."""
