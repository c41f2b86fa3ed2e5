"""Bench tests: `specdec bench` suites as a user runs them, on the tiny models, and the analysis of their results."""
