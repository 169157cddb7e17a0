"""Training jobs on Ray: a job's settings and what its workers are given (job), its checks before
Ray starts (preflight), resuming a recorded run and its segments (resume), starting Ray and the
trainer, and Ray's token file (ray_start), the metrics pump, summary and failure wording
(progress), running a job (launch), one job per engine (compare), the capacity search
(capacity), a trained run loaded back (trained), and the Ray Tune studies of many jobs (sweep;
one trial: trial; a study's results: study_results; the ranking lives in app/tracking/sweep_rank.py)."""
