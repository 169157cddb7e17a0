"""The report `mpipemoe report` writes from MLflow runs: the report (report), the runs of its
first sections (runs) and their plots (plots), and one module per later section (training,
simulate, capacity, emulated, memory_time, step); a section reads records and tracking only."""
