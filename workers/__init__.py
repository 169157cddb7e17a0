"""What runs inside each Ray Train worker: process groups, model, data shard, train loop,
metrics and checkpoints. Entry point: ``workers.loop.train_fn_per_worker(config)``."""
