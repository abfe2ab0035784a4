"""subnetdp-strided: an example third-party subnetdp plugin (the ``strided`` masker)."""
