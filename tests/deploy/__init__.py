"""Deployment tests: the Docker image and compose files, and the Kubernetes manifests."""
