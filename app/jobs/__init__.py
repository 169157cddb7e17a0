"""Training jobs on Ray: a job's settings, checks, resume rules and launch (launch), a trained
run loaded back (trained), the capacity search (capacity), and the Ray Tune studies of many jobs (sweep, sweep_rank)."""
