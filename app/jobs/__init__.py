"""Training jobs on Ray: a job's settings, checks and launch (launch), resuming a recorded run
(resume), one job per engine (compare), the capacity search (capacity), a trained run loaded
back (trained), and the Ray Tune studies of many jobs (sweep; one trial: trial; the ranking lives in app/tracking/sweep_rank.py)."""
