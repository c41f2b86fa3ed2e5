"""The target worker: holds the target model and verifies drafted tokens (TargetService)."""
