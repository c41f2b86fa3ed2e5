"""The draft worker: proposes tokens with the exact distributions they were sampled from (DraftService)."""
