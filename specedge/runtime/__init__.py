"""specedge runtime: backends, drafters, verifier and the speculative generator (no torch)."""
