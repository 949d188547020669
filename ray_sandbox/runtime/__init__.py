"""The Ray-free sandbox runtime: images, OCI bundles, runsc lifecycle, exec and files."""
