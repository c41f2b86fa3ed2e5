"""Process tests: clusters of real `specdec serve` processes, as a user starts them, and real clients against them."""
