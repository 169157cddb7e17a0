"""What `mpipemoe bench` and `mpipemoe simulate` measure and predict: the layer benchmark (layer;
one layer measured: measure; its bound: layer_bound; its summaries: layer_summary) and the
training step (step; its settings: step_settings; the step timed: step_training; the engines'
models: step_variants; one point: step_point; its bound: step_bound; its summaries:
step_summary), stacked layers (stack), the parts they share (parts), peer layers (peers),
timelines (timeline), the shapes (shapes), routings (routing_replay) and the simulator's
predictions against records (simulate; its settings: simulate_settings; its points:
simulate_points; against records: simulate_validation)."""
