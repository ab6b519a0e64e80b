"""jaxdp's implementation, in layered packages (CONTRIBUTING.md)."""
