"""The composition root: the one package that imports `server/`, `cluster/` and `durability/`
and wires them into a running daemon (`app.Daemon`, `app.serve`, `app.run_server`). `server/`
imports neither of the other two: it defines the seams (the `EngineListener`, the journal port
in `server/requests/durable.py`, the hooks the request table and registry leave `None` when alone) and
this package plugs the cluster and the journal into them."""
