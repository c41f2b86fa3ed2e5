"""The coordinator: the client-facing GenerationService, running the speculate-verify loop over both workers."""
