"""The report `mpipemoe report` writes from MLflow runs: the report and its plots (report), and one
module per section (training, simulate, capacity, emulated, memory_time, step); a section reads
records and tracking only."""
