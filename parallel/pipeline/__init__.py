"""Pipeline parallelism: stage partition, point-to-point exchange, and schedules."""
