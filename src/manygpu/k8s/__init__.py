"""Kubernetes manifests for manygpu jobs, by the Kubeflow operators' contract (no client)."""
