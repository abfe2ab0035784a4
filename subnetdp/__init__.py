"""subnetdp: Subnetwork Data Parallelism for PyTorch."""

__version__ = "0.1.0"
