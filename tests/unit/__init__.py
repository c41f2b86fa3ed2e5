"""Unit tests: functions and classes alone (sampling math, the gamma policy, kernels, models, parsers), and the
repository's own files (docs, protos, packaging)."""
