"""What the commands keep about their runs: MLflow logging and reading back (store), the offline
spool for an unreachable tracking server, one live job per run name (runlock), the provenance
every result file carries (records), the tag that says what made a run (run_kinds), and a
study's trials ranked (sweep_rank: read by the sweep as it ends and by the report), the tracking
server and its stores (server), and system metrics from every node of a run (node_metrics)."""
