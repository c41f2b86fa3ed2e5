"""`specdec bench`: measures the running system side by side with its baselines and the analytic model."""
